"""kvcanary under sglang 0.5.12's piecewise CUDA graph runner, which serves prefill (extend) forwards by default.

How 0.5.12 runs a prefill forward with piecewise graphs on (``model_runner.py`` ``forward_extend``,
``piecewise_cuda_graph_runner.py``): when ``runner.piecewise_cuda_graph_runner.can_run(batch)`` (extend or
mixed, no input embeddings, no logprobs from inside the prompt, at most ``max_num_tokens`` tokens), ``replay``
copies the batch into static buffers padded to the next capture size (padded tokens: id 0, position 0, slot 0,
and attention narrows every KV write to the real tokens), then calls ``runner.model.forward`` — the *top-level*
model, whose instance ``forward`` is kvcanary's wrapper — with the static batch. Only the layer stack
(``model.model``) is compiled (``install_torch_compiled``: torch.compile with a backend that splits the graph at
attention and replays one CUDA graph per piece); the wrapper and the logits processor around the layer stack run
eagerly. So the wrapper's plan/verify (before) and write (after) run eagerly on the forward's
stream around the replayed pieces, exactly as in an eager forward, and see exactly the ids, positions and slots
the pieces consume. The write plan covers the real tokens only (its ranges come from ``extend_seq_lens``), so
padded tokens are never written as records.

What this module adds:

* ``wrapper_gate(inst)``: per call of the wrapper, is it a real forward served by the piecewise runner
  (``WrapperCall.PIECEWISE``, counted apart in the host time), a capture-time forward of the piecewise runner
  (``SKIP``: ``PiecewiseCudaGraphRunner.__init__`` compiles and captures by calling ``model.forward`` with
  dummy batches, outside any ``ModelRunner.forward``; nothing of those is recorded), or anything else
  (``EAGER``: eager forwards and decode-graph capture, as before). ``BreakableCudaGraphRunner``
  (``--enable-breakable-cuda-graph``) replays the same way under its own flag; its capture calls the layer stack
  directly, never the wrapper. The wrapper itself only calls through while torch.compile traces it, so nothing of
  kvcanary can end up in a compiled graph or a captured piece.
* ``max_static_tokens(server_args)``: the largest padded token count a replay hands the wrapper.
* ``after_initialize(runner, inst)``: checks that the runner sglang built pads within the canary's buffers
  (an unknown runner class is refused by ``guards.check_after_initialize``), wraps ``model.forward`` again if
  compiling replaced it (a model whose layer stack is the top-level module), and logs what serves prefill.

The import paths and attribute names here are sglang 0.5.12's (``piecewise_cuda_graph_runner``,
``max_num_tokens``, ``capture_num_tokens``, ``piecewise_cuda_graph_tokens`` and the two context flags).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

from kvcanary.runtime.installation import Installation, WrapperCall
from kvcanary.sglang.refusal import UnsupportedSetupError

logger = logging.getLogger(__name__)


# sglang 0.5.12's two flags, module globals set while a piecewise (breakable) runner builds its graphs or replays
# them; its is_in_piecewise_cuda_graph / is_in_breakable_cuda_graph return them
PIECEWISE_FLAG = ("sglang.srt.compilation.piecewise_context_manager", "_in_piecewise_cuda_graph")
BREAKABLE_FLAG = ("sglang.srt.model_executor.breakable_cuda_graph.context", "_in_breakable_cuda_graph")


def _sglang_flag_modules() -> tuple[object, object]:
    """The two modules holding sglang's flags (:data:`PIECEWISE_FLAG`, :data:`BREAKABLE_FLAG`); a build without one
    is refused by name at install (the gate could not tell a piecewise replay from an eager forward)."""
    modules = []
    for module_name, flag in (PIECEWISE_FLAG, BREAKABLE_FLAG):
        module = importlib.import_module(module_name)
        if not hasattr(module, flag):
            raise UnsupportedSetupError(f"kvcanary: sglang's {module_name} has no {flag}: this is not the sglang "
                                        "0.5.12 kvcanary's piecewise-CUDA-graph gate was written for")
        modules.append(module)
    return modules[0], modules[1]


def wrapper_gate(inst: Installation, flag_modules: tuple[object, object] | None = None
                 ) -> Callable[[], WrapperCall]:
    """The classifier kvcanary's ``model.forward`` wrapper asks on each call (installed as ``inst.wrapper_call``).

    A piecewise runner's context flag is set both while it replays a real forward and while it compiles and
    captures at start-up; the installation's ``serving`` count (the ``ModelRunner.forward`` hook keeps it) tells
    the two apart: capture-time forwards never run inside ``ModelRunner.forward``. The gate reads sglang's two flag
    globals itself, not the functions that return them (a call less per flag on every prefill: the wrapper's only
    Python calls before its launch on a piecewise-served forward). ``flag_modules``: objects standing in for the two
    modules (a bench without sglang), each with its flag attribute.
    """
    pcg_module, bcg_module = flag_modules if flag_modules is not None else _sglang_flag_modules()

    def gate() -> WrapperCall:
        if not (pcg_module._in_piecewise_cuda_graph or bcg_module._in_breakable_cuda_graph):
            return WrapperCall.EAGER
        return WrapperCall.PIECEWISE if inst.serving else WrapperCall.SKIP

    return gate


def max_static_tokens(server_args) -> int:
    """Most tokens a piecewise replay hands ``model.forward``: the largest capture size (the batch padded up to it),
    0 with piecewise graphs off."""
    if getattr(server_args, "disable_piecewise_cuda_graph", True):
        return 0
    sizes = getattr(server_args, "piecewise_cuda_graph_tokens", None) or ()
    return max((int(s) for s in sizes), default=0)


def check_padding(pcg, inst: Installation) -> None:
    """Refuse, by name, a piecewise runner that pads prefill past the canary's token buffers (sized at install
    from ``server_args.piecewise_cuda_graph_tokens``; this catches a runner sized otherwise)."""
    padded = int(getattr(pcg, "max_num_tokens", 0) or 0)
    for group in inst.groups:
        if padded > group.manager.max_tokens_per_forward:
            raise UnsupportedSetupError(
                f"{type(pcg).__name__} pads prefill forwards to up to {padded} tokens, more than the canary's "
                f"{group.manager.max_tokens_per_forward}-token buffers of group {group.spec.name!r}: lower "
                "--piecewise-cuda-graph-max-tokens or pass --disable-piecewise-cuda-graph"
            )


def after_initialize(runner, inst: Installation) -> None:
    """After ``ModelRunner.initialize`` (decode and piecewise graphs are built): check the piecewise runner, keep
    kvcanary's wrapper on ``model.forward``, and say what serves prefill. Without one, stop asking the wrapper's gate:
    sglang's two context flags are only ever set by a piecewise runner, so every later call is an eager forward, and
    the gate's three Python calls per forward are host time for nothing."""
    pcg = getattr(runner, "piecewise_cuda_graph_runner", None)
    if pcg is None:
        inst.wrapper_call = None  # (the wrapper then takes every call as EAGER, asking nothing)
        return
    check_padding(pcg, inst)
    model = runner.model
    if not getattr(model.forward, "kvcanary_wrapped", False):
        # install_torch_compiled(module) replaces module.forward with its trampoline; when sglang picks the
        # top-level model as the layer stack, that is kvcanary's wrapper. Wrap the trampoline: the compiled code
        # is the class's forward, never the wrapper, and the replay calls model.forward, now the wrapper again.
        logger.info("kvcanary: %s replaced %s.forward; wrapping it again", type(pcg).__name__, type(model).__name__)
        inst.wrap_model_forward(model)
    sizes = list(getattr(pcg, "capture_num_tokens", ()) or ())
    logger.info(
        "kvcanary: prefill forwards of up to %s tokens are served by sglang's %s (%d capture sizes); the canary "
        "plans, verifies and writes them on the forward's stream around each replay",
        getattr(pcg, "max_num_tokens", "?"), type(pcg).__name__, len(sizes),
    )


__all__ = ["after_initialize", "check_padding", "max_static_tokens", "wrapper_gate"]
