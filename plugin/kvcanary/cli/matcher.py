"""Match injected faults to the violations the canary reported for them, from JSONL report records.

With ``KVCANARY_FAULT`` set, kvcanary writes one ``kvcanary.injection/1`` record per injected fault next to its
``kvcanary.violation/1`` records (``kvcanary.report``). The rule (the one ``integration/sglang_e2e.py`` applies to a
real engine's reports; that driver keeps its own copy because it never imports kvcanary):

* Records are matched only within one rank: the record's ``rank`` object, or, when a record has none, its file.
* An injection is **detected** when a violation with one of its class's expected reasons
  (``kvcanary.runtime.faults.EXPECTED_REASONS``) names one of its slots at a step in ``(step, step + window]``; the
  latency is that violation's step minus the injection's. An injection's ``step`` is the forward it was injected
  before, and a violation's step is the forward count when the host drained it, so a detection always has a
  larger step. The window is ``DEFAULT_WINDOW`` forwards (the default drain interval), longer for classes whose
  victim is read only when its request runs again (``WINDOWS``).
* A violation is **unexplained** when no injection at an earlier step touched its slot (a false positive, or
  collateral damage the injector did not name), and **late** when injections touched its slot but all of them
  more than a window earlier.
* A pool of several groups (sglang's ``SWAKVPool``: ``group=full`` and ``group=swa``) numbers its slots per group,
  and the injector acts on one group. A violation of another group, in a rank whose injections name a group, is an
  **echo** when a violation of the injections' group has the same rank (but for the group), step, request row,
  position and reasons: the same damage read through the other group's slots (a swapped token, a redirected row).
  Without such a twin it is unexplained.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcanary.runtime.faults import EXPECTED_REASONS, TOKEN_SWAP

DEFAULT_WINDOW = 8
# A swapped token is seen when its row's next forward verifies it, which may be many forwards later.
WINDOWS: Mapping[str, int] = {TOKEN_SWAP: 256}


@dataclass
class ClassMatch:
    """One fault class: how many injections, how many detected, with what latency, reasons and launch tags."""

    injected: int = 0
    detected: int = 0
    latencies: list[int] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)  # "+"-joined reasons of the matching violations
    tags: Counter[str] = field(default_factory=Counter)


@dataclass
class MatchResult:
    classes: dict[str, ClassMatch] = field(default_factory=dict)
    missed: list[dict[str, Any]] = field(default_factory=list)  # injections without a detection
    unexplained: list[dict[str, Any]] = field(default_factory=list)  # violations no earlier injection touched
    late: int = 0  # violations on touched slots, outside every window
    echoes: int = 0  # another group's violations with a twin in the injections' group (module docstring)

    @property
    def injected(self) -> int:
        return sum(c.injected for c in self.classes.values())

    @property
    def detected(self) -> int:
        return sum(c.detected for c in self.classes.values())


def rank_key(record: Mapping[str, Any], source: str = "") -> str:
    """Which rank a record belongs to: its ``rank`` object (canonical JSON), or its file when it has none."""
    rank = record.get("rank")
    return json.dumps(rank, sort_keys=True) if rank else f"file:{source}"


def _group(record: Mapping[str, Any]) -> str | None:
    return (record.get("rank") or {}).get("group")


def _twin(v: Mapping[str, Any]) -> tuple:
    """What a violation and its echo in another group of the same pool share (module docstring)."""
    rank = {k: val for k, val in (v.get("rank") or {}).items() if k != "group"}
    return (json.dumps(rank, sort_keys=True), v["step"], v.get("request_row"), v.get("position"),
            tuple(v["reasons"]))


def match_injections(
    injections: Iterable[tuple[str, Mapping[str, Any]]],
    violations: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    expected: Mapping[str, tuple[str, ...]] = EXPECTED_REASONS,
    windows: Mapping[str, int] = WINDOWS,
    default_window: int = DEFAULT_WINDOW,
) -> MatchResult:
    """Match ``kvcanary.injection/1`` records to ``kvcanary.violation/1`` records (module docstring).

    Each argument yields ``(rank key, record)`` pairs (:func:`rank_key`). Records are read, never changed.
    """
    res = MatchResult()
    by_slot: dict[tuple[str, int], list[Mapping[str, Any]]] = defaultdict(list)
    all_injections = []
    injected_keys: set[str] = set()
    for key, inj in injections:
        all_injections.append(inj)
        injected_keys.add(key)
        res.classes.setdefault(str(inj["fault"]), ClassMatch()).injected += 1
        for slot in inj["slots"]:
            by_slot[(key, int(slot))].append(inj)
    for lst in by_slot.values():
        lst.sort(key=lambda i: i["step"])
    violations = list(violations)
    # the injections' groups' violations, by what another group's echo of them shares
    twins = {_twin(v) for key, v in violations if key in injected_keys and _group(v) is not None}
    detected: set[int] = set()
    for key, v in violations:
        step = v["step"]
        if key not in injected_keys and _group(v) is not None and _twin(v) in twins:
            res.echoes += 1
            continue
        candidates = [i for i in by_slot.get((key, int(v["slot"])), ()) if i["step"] < step]
        if not candidates:
            res.unexplained.append(dict(v))
            continue
        in_window = False
        for inj in candidates:
            fault = str(inj["fault"])
            if step > inj["step"] + windows.get(fault, default_window):
                continue
            in_window = True
            if set(v["reasons"]) & set(expected.get(fault, ())):
                cls = res.classes[fault]
                if id(inj) not in detected:
                    detected.add(id(inj))
                    cls.detected += 1
                    cls.latencies.append(step - inj["step"])
                cls.reasons["+".join(v["reasons"])] += 1
                cls.tags[str(v.get("tag", "?"))] += 1
        if not in_window:
            res.late += 1
    res.missed = [dict(i) for i in all_injections if id(i) not in detected]
    return res
