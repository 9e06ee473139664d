"""``python -m kvcanary``: the same command line as the ``kvcanary`` console script."""

from __future__ import annotations

import sys

from kvcanary.cli import main

if __name__ == "__main__":
    sys.exit(main())
