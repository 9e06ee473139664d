"""Install guards: sglang setups kvcanary cannot protect are refused, each naming the setting to change.

Shared by the version modules, which call them with their own version string (the messages name it); a
version whose arguments differ gets its own guard beside these."""

from __future__ import annotations


class UnsupportedSetupError(RuntimeError):
    """An sglang setup kvcanary cannot protect; the message says what to change."""


def check_supported(server_args, sglang_version: str) -> None:
    """Refuse, before anything is built, server arguments kvcanary cannot protect on ``sglang_version``."""
    own = getattr(server_args, "kv_canary", None)  # later sglang versions: --kv-canary none|log|raise
    if own not in (None, False, "none", "off", ""):
        raise UnsupportedSetupError(
            f"sglang's own KV canary is enabled (--kv-canary {own}); kvcanary does not install twice: "
            "drop --kv-canary or unset KVCANARY_MODE"
        )
    # Piecewise CUDA graphs (prefill) are supported: the canary runs around each replay (kvcanary.sglang.piecewise).
    if getattr(server_args, "enable_torch_compile", False):
        raise UnsupportedSetupError(
            "--enable-torch-compile compiles model.forward, which kvcanary wraps; remove --enable-torch-compile"
        )
    if getattr(server_args, "enable_pdmux", False):
        raise UnsupportedSetupError(
            "split prefill (--enable-pdmux) calls model.forward_split_prefill, which bypasses kvcanary; "
            "remove --enable-pdmux"
        )
    from kvcanary.sglang.speculative import check_speculative  # (it raises this module's UnsupportedSetupError)

    check_speculative(server_args, sglang_version)  # EAGLE topk 1 on the spec-v2 worker; anything else refused


# The prefill graph runners kvcanary runs around (sglang 0.5.12's model_runner.init_piecewise_cuda_graphs): both
# replay the layer stack inside the top-level model.forward, which kvcanary wraps.
KNOWN_PIECEWISE_RUNNERS = ("PiecewiseCudaGraphRunner", "BreakableCudaGraphRunner")


def check_after_initialize(runner) -> None:
    """Refuse a prefill graph runner kvcanary does not know (it could replay model.forward itself)."""
    pcg = getattr(runner, "piecewise_cuda_graph_runner", None)
    if pcg is not None and type(pcg).__name__ not in KNOWN_PIECEWISE_RUNNERS:
        raise UnsupportedSetupError(
            f"prefill graphs are served by {type(pcg).__name__}, which kvcanary does not know (it runs around "
            f"{' and '.join(KNOWN_PIECEWISE_RUNNERS)}): pass --disable-piecewise-cuda-graph"
        )
