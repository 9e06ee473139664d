"""The kernels' Python side: the JIT build (``jit``), one typed wrapper module per kernel (``write``, ``verify``,
``plan_step``, ``check``, ``tokens``, ``row_serials``, ``sweep_plan``) over what they share (``call``: the kernel
spec, backend dispatch, real-KV arguments, named errors), the mirror of the headers' constants (``layout``, ``tags``),
the plan buffers (``plan``), real-KV sources (``real_kv``) and, beside each kernel it models, the pure-torch reference
the tests hold the kernels against (``write_ref``, ``verify_ref``, ``plan_step_ref``, ``check_ref``, sharing
``hash_ref``; ``sweep_plan_ref``). Nothing here knows a manager, a report or an engine."""
