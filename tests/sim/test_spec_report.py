"""Speculative decoding's report pieces: the ``pool=draft`` rank key on violation lines and JSONL rows, and the
``kvcanary.spec/1`` counter record (``Reporter.record``)."""

from __future__ import annotations

import json

import pytest

from kvcanary.kernels import layout
from kvcanary.report import Reporter, Violation, parse_log_line
from kvcanary.runtime.speculative import DRAFT_ROLE, TARGET_ROLE, SpecCounters


def _violation(rank) -> Violation:
    row = [1, 17, 63, 416, 1501, 5, 6, layout.REASON_VERIFY_TOKEN]
    return Violation.from_row(row, step=9, rank=rank)


def test_pool_rank_key_round_trips_through_the_log_line() -> None:
    v = _violation(DRAFT_ROLE.rank({"tp_rank": 1}))
    line = v.log_line()
    assert line.endswith("tp_rank=1 pool=draft")
    back = Violation.from_log_fields(parse_log_line("INFO " + line))
    assert back.rank == {"tp_rank": 1, "pool": "draft"} and back == v
    assert v.to_json()["rank"] == {"tp_rank": 1, "pool": "draft"}
    assert TARGET_ROLE.rank({"tp_rank": 0}) == {"tp_rank": 0, "pool": "target"}


@pytest.mark.parametrize("bad", ["Draft", "two words", "a=b", "", "9lives"])
def test_rank_values_are_ints_or_lower_case_words(bad: str) -> None:
    with pytest.raises(ValueError):
        _violation({"tp_rank": 0, "pool": bad})


def test_spec_record_goes_to_the_report(tmp_path) -> None:
    path = tmp_path / "kvc.jsonl"
    rank = DRAFT_ROLE.rank({"tp_rank": 0})
    reporter = Reporter("log", str(path), rank=rank)
    counters = SpecCounters()
    counters.add_draft_decode(rows=4, steps=1)
    counters.add_verdicts([0, 1, 0, 0], drafts_per_row=2)
    written = reporter.record(counters.record(40, "draft", None))
    reporter.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [written]
    assert rows[0]["schema"] == "kvcanary.spec/1" and rows[0]["rank"] == rank
    # rolled back: 7 rejected drafts + 4 draft-decode records (rewritten by the step's draft extend)
    assert rows[0]["counters"]["drafts_rejected"] == 7 and rows[0]["counters"]["rolled_back"] == 11
    assert Reporter("off").record({"schema": "x"}) is None
