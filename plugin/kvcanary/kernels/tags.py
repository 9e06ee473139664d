"""Launch tags: which kind of launch produced a violation row or advanced a health counter.

The manager passes the tag as ``kernel_kind`` to every kernel launch (it lands in column 0 of each violation
row it emits) and keeps one ``kernel_run_counter`` / ``slot_run_counter`` element per tag: int64 tensors of
shape ``[NUM_LAUNCH_TAGS]``, each launch getting the one-element view at its tag.

Unlike SGLang's built-in canary (12 tags: head/tail × K/V × full/SWA), kvcanary keeps one canary record per
slot and launches each kernel once per forward, so three tags suffice.
"""

from __future__ import annotations

import enum


class LaunchTag(enum.IntEnum):
    """The kind of a kernel launch; the value is the violation row's ``kernel_kind`` column."""

    VERIFY = 0  # per-forward verify of every running request's prefix (before the model)
    WRITE = 1  # per-forward write of the new records (after the model)
    SWEEP = 2  # periodic verify of every slot held by the prefix cache

    @property
    def label(self) -> str:
        """Lower-case name used in log lines and the JSONL report (``"verify"``, ``"write"``, ``"sweep"``)."""
        return self.name.lower()


NUM_LAUNCH_TAGS = len(LaunchTag)


def is_write(tag: int) -> bool:
    """Whether a launch with this tag is a write launch (its rows use write-row column semantics)."""
    return int(tag) == LaunchTag.WRITE


def tag_name(tag: int) -> str:
    """Lower-case name of a tag; an unknown value reads ``tag<N>`` (e.g. ``tag7``)."""
    try:
        return LaunchTag(int(tag)).label
    except ValueError:
        return f"tag{int(tag)}"
