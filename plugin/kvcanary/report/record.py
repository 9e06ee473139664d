"""Violation records and their two written forms, the log line and the JSONL objects (SPEC §3, §5);
``kvcanary.report.reporter`` emits them.

Log line (one line per violation, WARNING level; the format is frozen, tools parse it)::

    kvcanary violation: step=12 tag=verify reasons=verify_chain_hash+verify_position slot=17 position=3
    stored_token=101 expected_token=-1 stored_chain_hash=0x1a2b3c4d5e6f7081 expected_aux=0x0badc0ffee000001
    request_row=5 written_step=9 writer_rid=7f3a9c0d2b1e4f60a8c4d2e1f0b3a5c7 tp_rank=0

(printed here on three lines; it is one). Keys always appear in this order (``LOG_KEYS``); rank keys
(``tp_rank=0`` …) follow when the manager knows them. No value contains a space. Rules:

* ``tag``: ``verify``, ``write``, ``sweep`` or ``tag<N>`` for an unknown launch tag;
* ``reasons``: decoded fail_reason_bits joined by ``+`` (``layout.reason_names``; unknown bits ``bit<N>``);
* ``stored_chain_hash``: always ``0x%016x`` of the unsigned 64-bit value;
* ``expected_aux``: ``0x%016x`` when it is a hash (verify and sweep rows without ``slot_out_of_range``),
  otherwise a decimal int: the expected position on write rows, the offending index on rows with
  ``slot_out_of_range``;
* ``request_row``: the req_to_token row, or ``-`` when unknown;
* ``written_step``: the forward step that last wrote the slot (writer attribution), or ``-`` when unknown;
* ``via`` (only when it has a value): ``host_tier`` when the slot was last filled by a load-back from a host KV
  tier (its record and fingerprint are the first writer's, carried through the tier: a real-KV mismatch there
  means the host copy or the load-back went wrong);
* ``writer_rid``: the request id (sglang's rid) of that writer, or ``-`` when unknown. The rid is
  percent-encoded (``encode_rid``): every character other than ASCII letters, digits and ``-._~:/@+,`` (so
  whitespace, ``=``, ``%``, control and non-ASCII characters) becomes the ``%XX`` bytes of its UTF-8 form, and
  a rid that is exactly ``-`` is written ``%2D``; hex and uuid rids are written as they are.

``written_step``, ``writer_rid`` and ``via`` were added after the first release; lines without them (older logs)
still parse, with None (``OPTIONAL_LOG_KEYS``).

``parse_log_line`` is the inverse (``LOG_LINE_RE``) and ``Violation.from_log_fields`` rebuilds the record
(``repeats`` is not part of the record: it is ignored there).

Repeat summary line (log mode; ``kvcanary.report.reporter`` says when one is logged)::

    kvcanary violation repeated: tag=verify reasons=verify_chain_hash slot=17 position=3 count=17 first_step=13
    last_step=29 tp_rank=0

(one line; ``count`` rows from ``first_step`` to ``last_step`` were not logged). ``parse_log_line`` does not
match summary lines (the prefix differs); ``parse_repeat_line`` reads them.

JSONL report (``KVCANARY_REPORT``): one JSON object per line, four schemas:

* ``kvcanary.violation/1``: ``schema, step, tag, kernel_kind, reasons (list), fail_reason_bits, slot, position,
  stored_token, expected_token, stored_chain_hash (hex string), expected_aux (signed int), expected_aux_hex
  (hex string), expected_aux_kind ("hash" | "position" | "index"), request_row (int or null), written_step
  (int or null), writer_rid (string or null, not encoded), via ("host_tier" or null), rank (object or null),
  time (unix seconds)``;
* ``kvcanary.lost/1``: ``schema, count, step, rank, time``: rows the ring overflowed and could not keep;
* ``kvcanary.health/1``: ``schema, message, step, tags (list of names), rank, time``;
* ``kvcanary.injection/1`` (fault injection for tests only, ``KVCANARY_FAULT``): ``schema, fault, step, slots
  (list of ints), detail, rank, time``: one line per injected fault (``Reporter.record_injection``); ``step`` is
  the engine forward (0-based) the fault was injected before, so its violations carry a step > ``step``.
"""

from __future__ import annotations

import re
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcanary.kernels import layout
from kvcanary.kernels.tags import LaunchTag, is_write, tag_name
from kvcanary.report.repeats import RepeatSummary

VIOLATION_SCHEMA = "kvcanary.violation/1"
LOST_SCHEMA = "kvcanary.lost/1"
HEALTH_SCHEMA = "kvcanary.health/1"
INJECTION_SCHEMA = "kvcanary.injection/1"

LOG_PREFIX = "kvcanary violation:"
LOST_LOG_PREFIX = "kvcanary lost:"
HEALTH_LOG_PREFIX = "kvcanary health:"
REPEAT_LOG_PREFIX = "kvcanary violation repeated:"

# Keys of a violation log line, in order; rank keys follow.
LOG_KEYS: tuple[str, ...] = (
    "step",
    "tag",
    "reasons",
    "slot",
    "position",
    "stored_token",
    "expected_token",
    "stored_chain_hash",
    "expected_aux",
    "request_row",
    "written_step",
    "writer_rid",
    "via",
)
# Keys added after v1's first release: lines written before them lack these keys and still parse.
OPTIONAL_LOG_KEYS: tuple[str, ...] = ("written_step", "writer_rid", "via")
# ``via`` of a slot whose content came back from a host KV tier (kvcanary.runtime.host_tier)
VIA_HOST_TIER = "host_tier"
VIA_VALUES: tuple[str, ...] = (VIA_HOST_TIER,)
REQUIRED_LOG_KEYS: tuple[str, ...] = tuple(k for k in LOG_KEYS if k not in OPTIONAL_LOG_KEYS)
# Keys after the rank keys, only on some lines: ``repeats`` (log-mode repeat suppression).
TRAILING_LOG_KEYS: tuple[str, ...] = ("repeats",)
# Keys of a repeat summary line, in order; rank keys follow.
REPEAT_LOG_KEYS: tuple[str, ...] = ("tag", "reasons", "slot", "position", "count", "first_step", "last_step")
_KEY = r"[a-z_][a-z0-9_]*"
_RANK_KEY_RE = re.compile(rf"^{_KEY}$")
# A violation log line anywhere in a string (logging prefixes before it are allowed); group "fields" holds
# the space-separated key=value pairs.
LOG_LINE_RE = re.compile(rf"kvcanary violation:(?P<fields>(?: {_KEY}=\S+)+)[ \t]*$")
REPEAT_LINE_RE = re.compile(rf"kvcanary violation repeated:(?P<fields>(?: {_KEY}=\S+)+)[ \t]*$")
_FIELD_RE = re.compile(rf"({_KEY})=(\S+)")


_U64 = (1 << 64) - 1

_RANK_WORD_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def _rank_value(value: object) -> int | str:
    """A rank key's value: an int (``tp_rank=1``), or a lower-case word naming a pool (``pool=draft``, speculative
    decoding's two KV pools). Log lines give both as text: digits are read back as the int."""
    if isinstance(value, str) and _RANK_WORD_RE.match(value):
        return value
    return int(value)  # type: ignore[call-overload]


def hex64(value: int) -> str:
    """``0x%016x`` of the two's-complement unsigned 64-bit value (negative int64 hashes included)."""
    return f"0x{int(value) & _U64:016x}"


def from_hex64(text: str) -> int:
    """Inverse of ``hex64``: the signed int64 value (as stored in the ring)."""
    value = int(text, 16)
    return value - (1 << 64) if value >= 1 << 63 else value


# Characters a writer_rid keeps as they are in a log line; every other character (whitespace, ``=``, ``%``,
# control and non-ASCII characters) is percent-encoded as the %XX bytes of its UTF-8 form.
_RID_SAFE = "-._~:/@+,"


def encode_rid(rid: str | None) -> str:
    """``writer_rid`` as a log-line value: ``-`` for None, else percent-encoded so it holds no space or ``=``.

    A rid that is exactly ``-`` is written ``%2D`` so it cannot be read back as None.
    """
    if rid is None:
        return "-"
    if rid == "-":
        return "%2D"
    return urllib.parse.quote(rid, safe=_RID_SAFE)


def decode_rid(text: str) -> str | None:
    """Inverse of ``encode_rid``."""
    return None if text == "-" else urllib.parse.unquote(text, errors="strict")


def parse_log_line(line: str) -> dict[str, str]:
    """The key=value fields of a violation log line (the inverse of ``Violation.log_line``).

    Text before ``kvcanary violation:`` (a logging prefix) is ignored. Raises ``ValueError`` when ``line``
    holds no violation log line.
    """
    match = LOG_LINE_RE.search(line.rstrip("\r\n"))
    if match is None:
        raise ValueError(f"not a kvcanary violation log line: {line!r}")
    return dict(_FIELD_RE.findall(match.group("fields")))


def parse_repeat_line(line: str) -> dict[str, str]:
    """The key=value fields of a repeat summary line (``repeat_line``); ``ValueError`` if ``line`` holds none."""
    match = REPEAT_LINE_RE.search(line.rstrip("\r\n"))
    if match is None:
        raise ValueError(f"not a kvcanary repeat summary line: {line!r}")
    return dict(_FIELD_RE.findall(match.group("fields")))


def repeat_line(summary: RepeatSummary[Violation], *, rank: Mapping[str, int] | None = None) -> str:
    """The summary line for rows of one key that were suppressed and not yet counted on a ``repeats=`` key."""
    v = summary.violation
    parts = [
        f"tag={v.tag_name}",
        f"reasons={'+'.join(v.reasons) or '-'}",
        f"slot={v.slot}",
        f"position={v.position}",
        f"count={summary.count}",
        f"first_step={summary.first_step}",
        f"last_step={summary.last_step}",
    ]
    rank = v.rank or rank
    if rank:
        parts.extend(f"{k}={val}" for k, val in rank.items())
    return f"{REPEAT_LOG_PREFIX} {' '.join(parts)}"


@dataclass(frozen=True)
class Violation:
    """One violation ring row (SPEC §3 columns) plus what the host knows about it."""

    kernel_kind: int
    slot: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_reason_bits: int
    step: int
    request_row: int | None = None
    rank: Mapping[str, int] | None = field(default=None, hash=False)
    # Writer attribution (SPEC §7): the forward step that last wrote the slot and that writer's request id
    # (sglang's rid), None when unknown. An empty rid carries nothing and is stored as None.
    written_step: int | None = None
    writer_rid: str | None = None
    # How the slot's content got there when not by a forward's write: VIA_HOST_TIER (loaded back from a host tier)
    via: str | None = None

    def __post_init__(self) -> None:
        if self.via is not None and self.via not in VIA_VALUES:
            raise ValueError(f"via: expected None or one of {VIA_VALUES}; got {self.via!r}")
        if self.written_step is not None:
            object.__setattr__(self, "written_step", int(self.written_step))
        if self.writer_rid is not None:
            if not isinstance(self.writer_rid, str):
                raise ValueError(f"writer_rid: expected a str or None; got {self.writer_rid!r}")
            if not self.writer_rid:
                object.__setattr__(self, "writer_rid", None)
        if self.rank is not None:
            rank = {str(k): _rank_value(v) for k, v in self.rank.items()}
            for key in rank:
                if not _RANK_KEY_RE.match(key) or key in LOG_KEYS or key in TRAILING_LOG_KEYS:
                    raise ValueError(
                        f"rank key {key!r}: expected a lower-case identifier not in {LOG_KEYS + TRAILING_LOG_KEYS}"
                    )
            object.__setattr__(self, "rank", rank)

    @classmethod
    def from_row(
        cls,
        row: Sequence[int],
        *,
        step: int,
        request_row: int | None = None,
        rank: Mapping[str, int] | None = None,
        written_step: int | None = None,
        writer_rid: str | None = None,
        via: str | None = None,
    ) -> Violation:
        """From one ring row (8 ints, e.g. ``ring[i].tolist()``) and what the host knows beside it."""
        if len(row) != layout.VIOLATION_FIELDS:
            raise ValueError(f"violation row: expected {layout.VIOLATION_FIELDS} columns; got {len(row)}")
        v = [int(x) for x in row]
        return cls(
            kernel_kind=v[layout.VIOLATION_COL_KERNEL_KIND],
            slot=v[layout.VIOLATION_COL_SLOT],
            position=v[layout.VIOLATION_COL_POSITION],
            stored_token=v[layout.VIOLATION_COL_STORED_TOKEN],
            expected_token=v[layout.VIOLATION_COL_EXPECTED_TOKEN],
            stored_chain_hash=v[layout.VIOLATION_COL_STORED_CHAIN_HASH],
            expected_aux=v[layout.VIOLATION_COL_EXPECTED_AUX],
            fail_reason_bits=v[layout.VIOLATION_COL_FAIL_REASON_BITS],
            step=int(step),
            request_row=None if request_row is None else int(request_row),
            rank=rank,
            written_step=None if written_step is None else int(written_step),
            writer_rid=writer_rid,
            via=via,
        )

    @classmethod
    def from_log_fields(cls, fields: Mapping[str, str]) -> Violation:
        """Rebuild a violation from ``parse_log_line`` output (fail_reason_bits from the reason names).

        Reads lines with and without the optional keys (``OPTIONAL_LOG_KEYS``, absent from older lines).
        """
        missing = [k for k in REQUIRED_LOG_KEYS if k not in fields]
        if missing:
            raise ValueError(f"violation log fields: missing {', '.join(missing)}")
        bits = 0
        if fields["reasons"] != "-":
            by_name = {name: 1 << b for b in range(64) for name in layout.reason_names(1 << b)}
            for name in fields["reasons"].split("+"):
                bits |= by_name[name]
        tag = fields["tag"]
        kind = int(tag[3:]) if tag.startswith("tag") else int(LaunchTag[tag.upper()])
        aux = fields["expected_aux"]
        rank = {k: _rank_value(v) for k, v in fields.items() if k not in LOG_KEYS and k not in TRAILING_LOG_KEYS}
        return cls(
            kernel_kind=kind,
            slot=int(fields["slot"]),
            position=int(fields["position"]),
            stored_token=int(fields["stored_token"]),
            expected_token=int(fields["expected_token"]),
            stored_chain_hash=from_hex64(fields["stored_chain_hash"]),
            expected_aux=from_hex64(aux) if aux.startswith("0x") else int(aux),
            fail_reason_bits=bits,
            step=int(fields["step"]),
            request_row=None if fields["request_row"] == "-" else int(fields["request_row"]),
            rank=rank or None,
            written_step=None if fields.get("written_step", "-") == "-" else int(fields["written_step"]),
            writer_rid=decode_rid(fields.get("writer_rid", "-")),
            via=None if fields.get("via", "-") == "-" else fields["via"],
        )

    @property
    def reasons(self) -> tuple[str, ...]:
        """Decoded fail_reason_bits, lowest bit first."""
        return tuple(layout.reason_names(self.fail_reason_bits))

    @property
    def tag_name(self) -> str:
        """``verify``, ``write``, ``sweep`` or ``tag<N>``."""
        return tag_name(self.kernel_kind)

    @property
    def is_write(self) -> bool:
        return is_write(self.kernel_kind)

    @property
    def out_of_range(self) -> bool:
        """Whether the row carries the slot_out_of_range bit (then expected_aux is the offending index)."""
        return bool(self.fail_reason_bits & layout.REASON_SLOT_OUT_OF_RANGE)

    @property
    def expected_aux_kind(self) -> str:
        """What expected_aux holds: ``"index"`` (out-of-range rows), ``"position"`` (write rows) or ``"hash"``."""
        if self.out_of_range:
            return "index"
        if self.is_write:
            return "position"
        return "hash"

    def log_line(self, *, repeats: int = 0) -> str:
        """The one-line key=value form (module docstring); stable, parsed by ``parse_log_line``.

        ``repeats`` > 0 appends ``repeats=<N>`` after the rank keys (log-mode repeat suppression).
        """
        aux = hex64(self.expected_aux) if self.expected_aux_kind == "hash" else str(self.expected_aux)
        parts = [
            f"step={self.step}",
            f"tag={self.tag_name}",
            f"reasons={'+'.join(self.reasons) or '-'}",
            f"slot={self.slot}",
            f"position={self.position}",
            f"stored_token={self.stored_token}",
            f"expected_token={self.expected_token}",
            f"stored_chain_hash={hex64(self.stored_chain_hash)}",
            f"expected_aux={aux}",
            f"request_row={'-' if self.request_row is None else self.request_row}",
            f"written_step={'-' if self.written_step is None else self.written_step}",
            f"writer_rid={encode_rid(self.writer_rid)}",
        ]
        if self.via is not None:  # (only on such lines: every other line keeps v1's form)
            parts.append(f"via={self.via}")
        if self.rank:
            parts.extend(f"{k}={v}" for k, v in self.rank.items())
        if repeats > 0:
            parts.append(f"repeats={int(repeats)}")
        return f"{LOG_PREFIX} {' '.join(parts)}"

    def to_json(self, *, now: float | None = None) -> dict[str, Any]:
        """The ``kvcanary.violation/1`` JSONL object (module docstring); ``now`` defaults to ``time.time()``."""
        return {
            "schema": VIOLATION_SCHEMA,
            "step": self.step,
            "tag": self.tag_name,
            "kernel_kind": self.kernel_kind,
            "reasons": list(self.reasons),
            "fail_reason_bits": self.fail_reason_bits,
            "slot": self.slot,
            "position": self.position,
            "stored_token": self.stored_token,
            "expected_token": self.expected_token,
            "stored_chain_hash": hex64(self.stored_chain_hash),
            "expected_aux": self.expected_aux,
            "expected_aux_hex": hex64(self.expected_aux),
            "expected_aux_kind": self.expected_aux_kind,
            "request_row": self.request_row,
            "written_step": self.written_step,
            "writer_rid": self.writer_rid,
            "via": self.via,
            "rank": dict(self.rank) if self.rank else None,
            "time": time.time() if now is None else float(now),
        }
