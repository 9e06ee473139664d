"""The kernels' Python side: the JIT build (``jit``), the typed op wrappers (``ops``), the mirror of the headers'
constants (``layout``, ``tags``), the plan buffers (``plan``), real-KV sources (``real_kv``) and the pure-torch
reference the tests hold the kernels against (``ref``). Nothing here knows a manager, a report or an engine."""
