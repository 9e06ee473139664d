"""Install guards: sglang setups kvcanary cannot protect are refused, each naming the setting to change.

Shared by the version modules, which call them with their own version string (the messages name it); a
version whose arguments differ gets its own guard beside these."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcanary.sglang.refusal import UnsupportedSetupError

if TYPE_CHECKING:
    from kvcanary.sglang.audit import Finding

__all__ = ["UnsupportedSetupError", "check_supported"]  # (the error is refusal's, named here for the callers)


def check_supported(server_args, sglang_version: str) -> None:
    """Refuse, before anything is built, server arguments kvcanary cannot protect on ``sglang_version``: the
    audit's refused rows (:mod:`kvcanary.sglang.audit`) in table order, the first that applies raising with the flag
    as written, then the speculative setups :func:`~kvcanary.sglang.speculative.check_speculative` refuses."""
    from kvcanary.sglang.audit import GUARDS, refused_rows
    from kvcanary.sglang.speculative import check_speculative

    # Piecewise CUDA graphs (prefill) are supported: the canary runs around each replay (kvcanary.sglang.piecewise).
    for row in refused_rows():
        if row.raised_by == GUARDS and row.applies(server_args, sglang_version):
            raise UnsupportedSetupError(row.message(server_args, sglang_version))
    check_speculative(server_args, sglang_version)  # EAGLE topk 1 on the spec-v2 worker; anything else refused


def audit(server_args, sglang_version: str) -> list[Finding]:
    """Every audit row against ``server_args`` (``kvcanary check``): whether it applies, and its verdict."""
    from kvcanary.sglang.audit import evaluate

    return evaluate(server_args, sglang_version)


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
