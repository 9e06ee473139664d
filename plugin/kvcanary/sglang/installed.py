"""Where the adapter keeps a ModelRunner's :class:`~kvcanary.runtime.installation.Installation` (a leaf module: the
hooks, protect mode and a version module's own checks all read it, and none of them needs to import another for it)."""

from __future__ import annotations

from kvcanary.runtime.installation import Installation

# The attribute of a ModelRunner that holds its Installation.
INSTALL_ATTR = "_kvcanary"


def installation_of(runner) -> Installation | None:
    """The Installation on ``runner`` (None when kvcanary is not installed there)."""
    return getattr(runner, INSTALL_ATTR, None)


__all__ = ["INSTALL_ATTR", "installation_of"]
