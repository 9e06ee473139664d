"""The engine-agnostic runtime: one ``CanaryManager`` per KV pool (``manager``) composed of its parts (device
buffers and launches, the violation drain, the sweep, the token and writer tables, host-tier records, health), the
batch view an adapter fills (``batch``), the ``KVCANARY_*`` settings (``config``), the per-runner glue
(``installation``), protect mode's verdicts (``protect``) and the fault injectors (``faults``). It launches through
``kvcanary.kernels`` and reports through ``kvcanary.report``; it names no engine."""
