"""The error of a refused sglang setup (a leaf module: the guards, the audit's speculative rules and the adapter's
start-up checks all raise it, and none of them needs to import another for it)."""

from __future__ import annotations


class UnsupportedSetupError(RuntimeError):
    """An sglang setup kvcanary cannot protect; the message says what to change."""
