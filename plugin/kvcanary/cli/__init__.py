"""The ``kvcanary`` command (``main``: the console script, ``python -m kvcanary``) and what its subcommands run:
``doctor`` (build and self-test the kernels), ``demo`` (the real manager protecting the serving simulator), ``check``
(can this sglang be protected); ``kvcanary report`` reads files through ``kvcanary.cli.summarize`` and matches
detections to injected faults in ``kvcanary.cli.matcher``.

``kvcanary.cli.main`` is the entry point function; the module that defines it is imported as
``from kvcanary.cli.main import ...`` (an attribute lookup of ``kvcanary.cli.main`` finds the function).
"""

from __future__ import annotations

from kvcanary.cli.main import main

__all__ = ["main"]
