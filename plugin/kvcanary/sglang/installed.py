"""Where the adapter keeps a ModelRunner's :class:`~kvcanary.runtime.installation.Installation` and its
:class:`RunnerState` (a leaf module: the hooks, protect mode and a version module's own checks all read them, and none
of them needs to import another for it).

The Installation is the engine-agnostic core; what each adapter concern keeps per runner is that concern's own object,
grouped in the runner's :class:`RunnerState`, never a field written into the Installation from outside.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcanary.runtime.faults import FaultInjectionState
from kvcanary.runtime.host_ext import DecodeFill
from kvcanary.runtime.installation import Installation, TokenAppendPost, TokenColumnsUpload, TokenFilledPost

if TYPE_CHECKING:  # (leaf modules: neither imports this one)
    from kvcanary.sglang.hicache import HostTierFollower
    from kvcanary.sglang.tokens import TokenMirror

# The attribute of a ModelRunner that holds its Installation.
INSTALL_ATTR = "_kvcanary"
# The attribute of a ModelRunner that holds its RunnerState.
RUNNER_STATE_ATTR = "_kvcanary_adapter"


@dataclass(eq=False)
class RunnerState:
    """The adapter's state of one ModelRunner: its Installation and, per adapter concern, the object that concern owns
    (None: the concern is off on this runner)."""

    inst: Installation
    # KVCANARY_FAULT (tests only): the injector's state and the engine facts it reads (a
    # kvcanary.sglang.fault_injection.SglangFaultInjection; typed by its engine-agnostic base, since that module and
    # protect's read this one: a leaf imports neither)
    faults: FaultInjectionState | None = None
    # The token check (KVCANARY_VERIFY_TOKENS): what each req_to_token row was sent (kvcanary.sglang.tokens)
    token_mirror: TokenMirror = field(default_factory=dict)
    # ... and what sends a batch's updates to every group's table (Installation.expected_token_upload; None: the token
    # check is off)
    token_upload: TokenColumnsUpload | None = None
    # ... and what posts a decode batch (one token per row) to the token mail directly
    # (Installation.expected_token_post; None: no mail, every batch goes through token_upload)
    token_post: TokenAppendPost | None = None
    # ... and, where the host extension loads, what posts a decode batch read from its requests in C: the mail's
    # post_filled (Installation.expected_token_post_filled) and the extension's fill_decode
    # (kvcanary.sglang.tokens.decode_fill); both None or both set (None: every batch takes the Python path)
    token_post_filled: TokenFilledPost | None = None
    token_fill: DecodeFill | None = None
    # The prefix cache the sweep reads (set with the sweep source in after_init_cache; the fault injector's
    # cached_idle_corruption picks its idle slots there)
    prefix_cache: object | None = None
    # The follower of the host KV tier this runner's pool has (kvcanary.sglang.hicache; None: no host tier)
    host_tier: HostTierFollower | None = None
    # Protect mode (KVCANARY_MODE=protect): this runner's kvcanary.sglang.protect.Protector
    protect: object | None = None


_STATES: list[weakref.ReferenceType[RunnerState]] = []


def keep(runner, state: RunnerState) -> None:
    """Put ``state`` (and its Installation) on ``runner``; :func:`runner_states` lists it while the runner lives."""
    setattr(runner, INSTALL_ATTR, state.inst)
    setattr(runner, RUNNER_STATE_ATTR, state)
    _STATES.append(weakref.ref(state))


def installation_of(runner) -> Installation | None:
    """The Installation on ``runner`` (None when kvcanary is not installed there)."""
    return getattr(runner, INSTALL_ATTR, None)


def runner_state_of(runner) -> RunnerState | None:
    """The RunnerState on ``runner`` (None when kvcanary is not installed there)."""
    return getattr(runner, RUNNER_STATE_ATTR, None)


def runner_states() -> list[RunnerState]:
    """Live runner states in this process (one per hooked ModelRunner)."""
    alive = [r() for r in _STATES]
    _STATES[:] = [r for r, s in zip(_STATES, alive, strict=False) if s is not None]
    return [s for s in alive if s is not None]


__all__ = ["INSTALL_ATTR", "RUNNER_STATE_ATTR", "RunnerState", "installation_of", "keep", "runner_state_of",
           "runner_states"]
