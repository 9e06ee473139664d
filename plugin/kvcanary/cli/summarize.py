"""``kvcanary report``: read JSONL report files (``KVCANARY_REPORT``, one per rank) and summarise them.

:func:`read_reports` reads every line of every file, checks it against the record schemas of
:mod:`kvcanary.report` and keeps going past a bad line (not JSON, cut off, not a kvcanary record, a field missing
or of the wrong type, not UTF-8), which it reports as ``file:line: what is wrong`` with the line's start escaped
(a binary file never reaches the terminal raw). ``-`` is stdin; a FIFO or character device is read as a stream
(``/dev/null`` is an empty report); a directory is refused by name. :class:`ReportSummary` holds what the
records say: violations per reason, rank, tag, slot and request, the step range, lost and health records, and the
injections (``kvcanary.injection/1``) matched to violations by :func:`kvcanary.cli.matcher.match_injections`.
:func:`render` is the text form, :meth:`ReportSummary.to_json` the machine form.

:func:`explain` names a pattern of violations only where the records pin it (:data:`EAGLE_DRAFT_WRONG_TOKEN`); a
report it cannot pin gets no explanation, never a guess.
"""

from __future__ import annotations

import glob
import json
import os
import stat
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcanary.cli.matcher import DEFAULT_WINDOW, WINDOWS, MatchResult, match_injections, rank_key
from kvcanary.report.record import HEALTH_SCHEMA, INJECTION_SCHEMA, LOST_SCHEMA, VIOLATION_SCHEMA
from kvcanary.report.table import format_table

TOP = 10  # rows of the top-slots and top-requests tables
MAX_LISTED = 5  # bad lines, health messages and unexplained violations shown in the text form
EXCERPT = 80  # characters (bytes, for a line that is not UTF-8) of a bad line or value quoted in its message
STDIN = "<stdin>"  # how the file ``-`` is named in the summary and the bad-line messages
_SCHEMA_PREFIX = "kvcanary."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_or_null(v: object) -> bool:
    return v is None or _is_int(v)


def _list_of(kind: type) -> Any:
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in v)


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def _rank_ok(v: object) -> bool:
    """A rank object: integer rank keys (``tp_rank`` ...), and names such as EAGLE's ``pool`` (``target``/``draft``)."""
    return v is None or (isinstance(v, dict) and all(_is_int(x) or (_is_str(x) and x and " " not in x)
                                                     for x in v.values()))


SPEC_SCHEMA = "kvcanary.spec/1"  # speculative-decoding counters per pool (kvcanary.runtime.speculative), cumulative

# The one pattern ``kvcanary report`` explains (:func:`explain`): the EAGLE draft was fed a token other than the
# request's own next token. docs/upstream-bugs/README.md names the sglang bugs known to do that.
EAGLE_DRAFT_WRONG_TOKEN = "eagle_draft_wrong_token"
EXPLANATION_LINES: Mapping[str, str] = {
    EAGLE_DRAFT_WRONG_TOKEN: "explained: EAGLE draft fed the wrong token (sglang #26329 / #28254); "
                             "see docs/upstream-bugs/README.md",
}


# Fields each schema must carry, with their check; other fields are optional (newer writers may add some).
REQUIRED: Mapping[str, Mapping[str, Any]] = {
    VIOLATION_SCHEMA: {"step": _is_int, "tag": _is_str, "reasons": _list_of(str), "slot": _is_int,
                       "request_row": _int_or_null, "rank": _rank_ok},
    LOST_SCHEMA: {"count": _is_int, "step": _int_or_null, "rank": _rank_ok},
    HEALTH_SCHEMA: {"message": _is_str, "step": _int_or_null, "tags": _list_of(str), "rank": _rank_ok},
    INJECTION_SCHEMA: {"fault": _is_str, "step": _is_int, "slots": _list_of(int), "rank": _rank_ok},
    SPEC_SCHEMA: {"step": _int_or_null, "pool": _is_str, "counters": lambda v: isinstance(v, dict), "rank": _rank_ok},
}


@dataclass(frozen=True)
class BadLine:
    path: str
    line: int
    error: str

    def __str__(self) -> str:
        where = self.path if self.path.isprintable() else repr(self.path)  # a file name is terminal input too
        return f"{where}: {self.error}" if self.line == 0 else f"{where}:{self.line}: {self.error}"  # 0: the file


@dataclass(frozen=True)
class Record:
    """One valid record, with where it came from."""

    path: str
    line: int
    data: Mapping[str, Any]

    @property
    def schema(self) -> str:
        return str(self.data["schema"])

    @property
    def rank_key(self) -> str:
        return rank_key(self.data, self.path)

    @property
    def rank_label(self) -> str:
        """``tp_rank=1 pp_rank=0`` from the record's rank object, else its file's name."""
        rank = self.data.get("rank")
        if rank:
            return " ".join(f"{k}={v}" for k, v in rank.items())
        return f"({os.path.basename(self.path)})"


def expand_paths(patterns: Sequence[str]) -> tuple[list[str], list[str]]:
    """Paths and glob patterns → (what to read, in order; patterns that name nothing).

    A glob keeps the regular files it matches. A plain path is kept when it exists, whatever it is: ``-`` (as
    :data:`STDIN`), a FIFO or a character device are streams, and a directory or an unreadable file is kept so that
    :func:`iter_file` says what is wrong with it instead of "no such file".
    """
    files: list[str] = []
    unmatched: list[str] = []
    for pattern in patterns:
        if pattern == "-":
            found = [STDIN]
        elif glob.has_magic(pattern):
            found = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
        else:
            found = [pattern] if _exists(pattern) else []
        if not found:
            unmatched.append(pattern)
        files.extend(p for p in found if p not in files)
    return files, unmatched


def _exists(path: str) -> bool:
    try:
        os.stat(path)  # follows links: /dev/fd/63 of a shell's <(...) is the FIFO behind it
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True  # there, but not for us (a directory we cannot enter): opening it names the reason
    return True


def _short_repr(value: object) -> str:
    """``repr`` of at most :data:`EXCERPT` characters (and ``...`` when cut): quoted and escaped, so control
    characters and binary bytes never reach a terminal raw."""
    if not isinstance(value, (str, bytes)):
        text = repr(value)
        return text if len(text) <= EXCERPT else text[:EXCERPT] + "..."
    n = len(value)
    while n > 1 and len(repr(value[:n])) > EXCERPT:  # whole escapes only: shorten the value, not its repr
        n = n * 3 // 4
    return repr(value[:n]) + ("..." if n < len(value) else "")


def check_record(obj: object) -> str | None:
    """Why ``obj`` (a parsed JSON line) is not a valid kvcanary record, or None if it is."""
    if not isinstance(obj, dict):
        return f"not a kvcanary record (a JSON {type(obj).__name__}, expected an object with a 'schema')"
    schema = obj.get("schema")
    if not isinstance(schema, str) or not schema.startswith(_SCHEMA_PREFIX):
        return f"not a kvcanary record (schema {_short_repr(schema)})"
    required = REQUIRED.get(schema)
    if required is None:
        return f"unsupported kvcanary schema {_short_repr(schema)} (this kvcanary reads {', '.join(REQUIRED)})"
    for name, ok in required.items():
        if name not in obj:
            return f"{schema}: missing field {name!r}"
        if not ok(obj[name]):
            return f"{schema}: field {name!r} has a bad value {_short_repr(obj[name])}"
    return None


def iter_file(path: str) -> Iterator[Record | BadLine]:
    """Every line of one JSONL file (or :data:`STDIN`, a FIFO, a device) as a Record or a BadLine; empty lines
    are skipped. A file that cannot be read at all is one BadLine at line 0."""
    if path == STDIN:
        yield from _iter_lines(path, sys.stdin.buffer)  # not closed: stdin is the process's
        return
    try:
        if stat.S_ISDIR(os.stat(path).st_mode):
            yield BadLine(path, 0, f"is a directory; give the files or a glob like {os.path.join(path, '*.jsonl')!r}")
            return
        f = open(path, "rb")  # noqa: SIM115 - closed below; bytes, so a line that is not UTF-8 is a bad line
    except OSError as exc:
        yield BadLine(path, 0, f"cannot read: {exc.strerror or exc}")
        return
    with f:
        yield from _iter_lines(path, f)


def _iter_lines(path: str, f: Iterable[bytes]) -> Iterator[Record | BadLine]:
    for n, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        complete = raw.endswith(b"\n")
        cut = "truncated line (no newline at the end of the file)"
        try:
            text = raw.decode("utf-8")  # strict: json.loads(bytes) would also take UTF-16 and UTF-32
        except UnicodeDecodeError as exc:
            at_end = not complete and exc.reason == "unexpected end of data"  # a character cut by the writer
            excerpt = _short_repr(raw.rstrip(b"\r\n"))  # a bytes repr: binary never reaches the terminal raw
            yield BadLine(path, n, f"{cut if at_end else 'not UTF-8 text'}: {excerpt}")
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            yield BadLine(path, n, f"{'not JSON' if complete else cut}: {_short_repr(text.rstrip())}")
            continue
        error = check_record(obj)
        if error is not None:
            yield BadLine(path, n, error)
        else:
            yield Record(path, n, obj)


@dataclass(frozen=True)
class Explanation:
    """A pattern every violation of the report fits (:func:`explain`), with the line ``kvcanary report`` prints."""

    pattern: str
    line: str
    violations: int
    slots: int  # distinct (rank, slot)
    positions: tuple[int, ...]  # distinct positions, ascending


@dataclass
class RankSummary:
    violations: int = 0
    first_step: int | None = None
    last_step: int | None = None
    lost: int = 0
    health: int = 0
    injections: int = 0

    def saw_step(self, step: int) -> None:
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.last_step = step if self.last_step is None else max(self.last_step, step)


@dataclass
class ReportSummary:
    """What a set of JSONL report files says (module docstring)."""

    files: dict[str, int] = field(default_factory=dict)  # path -> valid records
    records: Counter[str] = field(default_factory=Counter)  # schema -> records
    bad_lines: list[BadLine] = field(default_factory=list)
    violations: int = 0
    first_step: int | None = None
    last_step: int | None = None
    by_reason: Counter[str] = field(default_factory=Counter)  # each reason a violation carries counts once
    by_combo: Counter[str] = field(default_factory=Counter)  # the "+"-joined reasons of each violation
    by_tag: Counter[str] = field(default_factory=Counter)
    # how the slot's content got there when not by a forward's write ("host_tier": loaded back from a host KV tier)
    by_via: Counter[str] = field(default_factory=Counter)
    ranks: dict[str, RankSummary] = field(default_factory=dict)  # rank label -> summary
    slots: Counter[tuple[str, int]] = field(default_factory=Counter)  # (rank label, slot)
    slot_reasons: dict[tuple[str, int], Counter[str]] = field(default_factory=dict)
    request_rows: Counter[tuple[str, int]] = field(default_factory=Counter)  # (rank label, request_row)
    writers: Counter[tuple[str, str]] = field(default_factory=Counter)  # (rank label, writer_rid), when recorded
    lost_rows: int = 0
    lost_records: int = 0
    health: list[Record] = field(default_factory=list)
    speculative: dict[str, dict[str, Any]] = field(default_factory=dict)  # rank label -> its last spec counters
    matches: MatchResult | None = None  # None without injection records
    explanations: list[Explanation] = field(default_factory=list)  # explain(): empty unless a pattern is pinned

    def rank(self, label: str) -> RankSummary:
        return self.ranks.setdefault(label, RankSummary())

    def to_json(self) -> dict[str, Any]:
        def top(counter: Counter[tuple[str, Any]], name: str) -> list[dict[str, Any]]:
            return [{"rank": r, name: k, "violations": n} for (r, k), n in counter.most_common(TOP)]

        out: dict[str, Any] = {
            "schema": "kvcanary.report-summary/1",
            "files": self.files,
            "records": dict(self.records),
            "bad_lines": [{"path": b.path, "line": b.line, "error": b.error} for b in self.bad_lines],
            "violations": self.violations,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "by_reason": dict(self.by_reason.most_common()),
            "by_reasons_combination": dict(self.by_combo.most_common()),
            "by_tag": dict(self.by_tag.most_common()),
            "by_via": dict(self.by_via.most_common()),
            "by_rank": {label: vars(r) for label, r in sorted(self.ranks.items())},
            "top_slots": top(self.slots, "slot"),
            "top_request_rows": top(self.request_rows, "request_row"),
            "top_writer_rids": top(self.writers, "writer_rid"),
            "lost": {"records": self.lost_records, "rows": self.lost_rows},
            "health": [dict(h.data) for h in self.health],
            "speculative": self.speculative,
            "injections": None,
            "explanations": [{"pattern": e.pattern, "line": e.line, "violations": e.violations, "slots": e.slots,
                              "positions": list(e.positions)} for e in self.explanations],
        }
        m = self.matches
        if m is not None:
            out["injections"] = {
                "windows": {"default": DEFAULT_WINDOW, **WINDOWS},
                "classes": {
                    name: {"injected": c.injected, "detected": c.detected, "latency_forwards": sorted(c.latencies),
                           "reasons": dict(c.reasons), "tags": dict(c.tags)}
                    for name, c in m.classes.items()
                },
                "missed": m.missed,
                "unexplained": len(m.unexplained),
                "unexplained_first": m.unexplained[:MAX_LISTED],
                "late": m.late,
                "echoes": m.echoes,
            }
        return out


def summarize(items: Iterable[Record | BadLine], files: Sequence[str] = ()) -> ReportSummary:
    """Fold records (and bad lines) into a :class:`ReportSummary`; matches injections when there are any."""
    s = ReportSummary(files={p: 0 for p in files})
    injections: list[tuple[str, Mapping[str, Any]]] = []
    violations: list[tuple[str, Mapping[str, Any]]] = []
    for item in items:
        if isinstance(item, BadLine):
            s.bad_lines.append(item)
            continue
        d = item.data
        s.files[item.path] = s.files.get(item.path, 0) + 1
        s.records[item.schema] += 1
        label = item.rank_label
        rank = s.rank(label)
        if item.schema == VIOLATION_SCHEMA:
            step = d["step"]
            s.violations += 1
            rank.violations += 1
            rank.saw_step(step)
            s.first_step = step if s.first_step is None else min(s.first_step, step)
            s.last_step = step if s.last_step is None else max(s.last_step, step)
            s.by_reason.update(d["reasons"])
            s.by_combo["+".join(d["reasons"]) or "-"] += 1
            s.by_tag[d["tag"]] += 1
            via = d.get("via")
            if isinstance(via, str) and via:
                s.by_via[via] += 1
            s.slots[(label, d["slot"])] += 1
            s.slot_reasons.setdefault((label, d["slot"]), Counter())["+".join(d["reasons"])] += 1
            if d.get("request_row") is not None:
                s.request_rows[(label, d["request_row"])] += 1
            rid = d.get("writer_rid")
            if isinstance(rid, str) and rid:  # the request id of the forward that wrote the slot (newer writers)
                s.writers[(label, rid)] += 1
            violations.append((item.rank_key, d))
        elif item.schema == LOST_SCHEMA:
            s.lost_records += 1
            s.lost_rows += d["count"]
            rank.lost += d["count"]
        elif item.schema == HEALTH_SCHEMA:
            s.health.append(item)
            rank.health += 1
        elif item.schema == INJECTION_SCHEMA:
            rank.injections += 1
            injections.append((item.rank_key, d))
        elif item.schema == SPEC_SCHEMA:  # cumulative: the latest line of a pool says it all
            last = s.speculative.get(label)
            if last is None or (d["step"] or 0) >= (last.get("step") or 0):
                s.speculative[label] = {"step": d["step"], **d["counters"]}
    if injections:
        s.matches = match_injections(injections, violations)
    s.explanations = explain(s, violations)
    return s


def _wrong_draft_token(d: Mapping[str, Any]) -> bool:
    """One violation record as the EAGLE draft being fed the wrong token leaves it: in the draft pool, from a verify
    launch, the token check and nothing else failing (the record's chain hash and position agree with the request,
    only its token does not), and both tokens known and different."""
    rank = d.get("rank") or {}
    stored, expected = d.get("stored_token"), d.get("expected_token")
    return (rank.get("pool") == "draft" and d["tag"] == "verify" and d["reasons"] == ["verify_token"]
            and _is_int(stored) and _is_int(expected) and expected >= 0 and stored != expected)


def explain(s: ReportSummary, violations: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Explanation]:
    """The patterns the report's violations (``(rank key, record)``) pin with certainty; empty when they pin none.

    :data:`EAGLE_DRAFT_WRONG_TOKEN`: every violation is a draft-pool (``rank.pool == "draft"``) ``verify_token``
    row of a verify launch with ``stored_token != expected_token`` (the draft KV at that position was built from a
    token other than the request's next one: docs/adapter.md, "Speculative decoding"), so none is in the target
    pool, none has another reason, none is a write or sweep row. Nothing may be hidden from the check either: a
    bad line, a lost row (the ring overflowed) or an injection (``KVCANARY_FAULT``; the fault matcher accounts for
    those) leaves the report unexplained. The JSONL carries no chunk boundaries, so the explanation says which
    token went wrong, not which sglang code path fed it; docs/upstream-bugs/README.md lists the known ones.
    """
    if not violations or s.bad_lines or s.lost_rows or s.lost_records or s.matches is not None:
        return []
    if not all(_wrong_draft_token(d) for _, d in violations):
        return []
    slots = {(key, d["slot"]) for key, d in violations}
    positions = tuple(sorted({int(d["position"]) for _, d in violations if _is_int(d.get("position"))}))
    return [Explanation(EAGLE_DRAFT_WRONG_TOKEN, EXPLANATION_LINES[EAGLE_DRAFT_WRONG_TOKEN], len(violations),
                        len(slots), positions)]


def read_reports(patterns: Sequence[str]) -> tuple[ReportSummary, list[str]]:
    """Summarise the files the paths / globs name; also returns the patterns that matched no file."""
    files, unmatched = expand_paths(patterns)
    items: Iterator[Record | BadLine] = (item for path in files for item in iter_file(path))
    return summarize(items, files), unmatched


# ------------------------------------------------------------------------------------------------ text form
def _steps(first: int | None, last: int | None) -> str:
    return "-" if first is None else f"{first}..{last}"


def _latency(values: list[int]) -> str:
    return "-" if not values else (str(min(values)) if min(values) == max(values) else f"{min(values)}..{max(values)}")


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k}×{n}" for k, n in counter.most_common()) or "-"


def render(s: ReportSummary) -> str:
    """The ``kvcanary report`` text output."""
    kinds = ", ".join(f"{s.records[k]} {k.split('.', 1)[1].split('/')[0]}" for k in REQUIRED if s.records[k])
    lines = [f"kvcanary report: {len(s.files)} file(s), {sum(s.records.values())} records ({kinds or 'none'}), "
             f"{len(s.bad_lines)} bad line(s)"]
    bad_by_file = Counter(b.path for b in s.bad_lines)
    for path, n in s.files.items():
        extra = f", {bad_by_file[path]} bad" if bad_by_file[path] else ""
        lines.append(f"  {path}: {n} records{extra}" + (" (empty)" if not n and not extra else ""))
    lines += ["", f"violations: {s.violations}, steps {_steps(s.first_step, s.last_step)}"]
    if s.violations:
        lines += ["", format_table([(r, str(n)) for r, n in s.by_reason.most_common()], ("reason", "violations"),
                                   right=(1,))]
        lines += ["", format_table([(c, str(n)) for c, n in s.by_combo.most_common()],
                                   ("reasons (as reported together)", "violations"), right=(1,))]
        lines += ["", format_table([(t, str(n)) for t, n in s.by_tag.most_common()], ("tag", "violations"),
                                   right=(1,))]
        if s.by_via:  # (only when a slot's content came another way than a forward's write: a host KV tier)
            lines += ["", format_table([(v, str(n)) for v, n in s.by_via.most_common()],
                                       ("slot content came via", "violations"), right=(1,))]
    if s.ranks:
        rows = [(label, str(r.violations), _steps(r.first_step, r.last_step), str(r.lost), str(r.health),
                 str(r.injections)) for label, r in sorted(s.ranks.items())]
        lines += ["", format_table(rows, ("rank", "violations", "steps", "lost rows", "health", "injections"),
                                   right=(1, 3, 4, 5))]
    if s.slots:
        rows = [(label, str(slot), str(n), _counts(s.slot_reasons[(label, slot)]))
                for (label, slot), n in s.slots.most_common(TOP)]
        lines += ["", f"top {min(TOP, len(s.slots))} of {len(s.slots)} slots:",
                  format_table(rows, ("rank", "slot", "violations", "reasons"), right=(1, 2))]
    for title, counter, key in (("request rows (request_row)", s.request_rows, "request_row"),
                                ("writers (writer_rid)", s.writers, "writer_rid")):
        if counter:
            rows = [(label, str(k), str(n)) for (label, k), n in counter.most_common(TOP)]
            lines += ["", f"top {min(TOP, len(counter))} of {len(counter)} {title}:",
                      format_table(rows, ("rank", key, "violations"), right=(1, 2))]
    if s.violations and not s.request_rows and not s.writers:
        lines += ["", "requests: no violation names its request (request_row / writer_rid are null or absent)"]
    lines += ["", f"lost: {s.lost_rows} violation rows the ring could not keep ({s.lost_records} lost records)",
              f"health: {len(s.health)} record(s)"]
    for h in s.health[:MAX_LISTED]:
        lines.append(f"  step={h.data.get('step')} {h.rank_label}: {h.data['message']}")
    if s.speculative:
        keys = ("step", "verify_forwards", "drafts_written", "drafts_accepted", "drafts_rejected", "rolled_back")
        rows = [(label, *(str(c.get(k, "-")) for k in keys)) for label, c in sorted(s.speculative.items())]
        lines += ["", "speculative decoding (last kvcanary.spec/1 line per pool):",
                  format_table(rows, ("rank", *keys), right=tuple(range(1, len(keys) + 1)))]
    m = s.matches
    if m is None:
        lines += ["", "injections: none (kvcanary.injection/1 records appear only with KVCANARY_FAULT)"]
    else:
        windows = ", ".join(f"{k} {v}" for k, v in WINDOWS.items())
        lines += ["", f"injections matched to violations (same rank and slot, within {DEFAULT_WINDOW} forwards; "
                      f"{windows}):"]
        rows = [(name, str(c.injected), str(c.detected), f"{100.0 * c.detected / max(c.injected, 1):.0f} %",
                 _latency(c.latencies), _counts(c.reasons), _counts(c.tags))
                for name, c in m.classes.items()]
        lines.append(format_table(rows, ("fault class", "injected", "detected", "rate", "latency (forwards)",
                                         "reasons (matched violations)", "tags"), right=(1, 2, 3)))
        lines.append(f"violations on slots no earlier injection touched: {len(m.unexplained)}; late (outside every "
                     f"window): {m.late}; injections without a detection: {len(m.missed)}"
                     + (f"; another group's lines of the same detections: {m.echoes}" if m.echoes else ""))
        for v in m.unexplained[:MAX_LISTED]:
            lines.append(f"  unexplained: step={v['step']} tag={v['tag']} reasons={'+'.join(v['reasons'])} "
                         f"slot={v['slot']}")
        for i in m.missed[:MAX_LISTED]:
            lines.append(f"  missed: step={i['step']} {i['fault']} slots={i['slots']} {i.get('detail', '')}")
    if s.bad_lines:
        lines += ["", f"bad lines: {len(s.bad_lines)}"]
        lines += [f"  {b}" for b in s.bad_lines[:MAX_LISTED]]
        if len(s.bad_lines) > MAX_LISTED:
            lines.append(f"  ... and {len(s.bad_lines) - MAX_LISTED} more")
    if s.explanations:
        lines.append("")
        lines += [e.line for e in s.explanations]
    return "\n".join(lines)
