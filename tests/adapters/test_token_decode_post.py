"""The host extension's decode post (``kvcanary/runtime/decode_post.c``, issue 25) against the Python path it
replaces for decode batches: :func:`kvcanary.sglang.tokens.expected_token_columns` and then ``TokenMail.post``.

For every batch, the C call either posts exactly what the Python path would have posted (the same records in the
same ring slots, the same mirror afterwards) or refuses it with the mirror untouched, and then the Python path runs
as before. The requests are built to hit every way a row can fail the decode rule or the mail's bounds."""

from __future__ import annotations

import random
import shlex
import subprocess
import sysconfig
import weakref

import pytest

from kvcanary.kernels import layout
from kvcanary.runtime import host_ext
from kvcanary.runtime.token_table import TokenMail
from kvcanary.sglang import tokens as sglang_tokens
from kvcanary.sglang.tokens import DECODE_NAMES, expected_token_columns

ROWS, WIDTH = 16, 1 << 12
READ_AT = layout.STATE_TOKEN_MAIL_READ  # the header index of the device's read cursor


@pytest.fixture(scope="module")
def fill():
    try:
        return host_ext.decode_fill()
    except host_ext.HostExtError as exc:  # CI installs the Python headers: a failure there is a failure
        pytest.fail(f"the host extension did not build: {exc}")


class Req:
    def __init__(self, row, origin, output) -> None:
        self.req_pool_idx, self.origin_input_ids, self.output_ids = row, origin, output


class Steps:
    steps = 7


def _mail(capacity: int = 64) -> tuple[TokenMail, list[int]]:
    mail = TokenMail(capacity, pinned=False)
    header = [0] * 64
    mail.open(header, Steps, ROWS, WIDTH)
    return mail, header


def _mirror_state(mirror: dict) -> dict:
    """The mirror as comparable values: row -> (the referenced object's id, tokens sent, last token sent)."""
    out = {}
    for row, (ref, sent, last) in mirror.items():
        obj = ref() if ref is not None else None
        out[row] = (id(obj) if obj is not None else None, sent, last)
    return out


def _python_post(mail: TokenMail, mirror: dict, reqs: list) -> bool:
    """The Python path of the batch hook for one batch: the columns, then the mail's post of a decode batch."""
    rows, starts, _counts, runs = expected_token_columns(mirror, reqs)
    return len(runs) == 1 and len(runs[0]) == len(rows) and mail.post(rows, starts, runs[0])


def test_the_extension_builds_without_a_warning(tmp_path) -> None:
    """The source compiles with -Wall -Werror for this Python (the runtime build leaves -Werror out: a newer
    Python's headers may warn)."""
    command = host_ext.compile_command(host_ext.SOURCE, tmp_path / "ext.so", "-Wextra", "-Werror")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{shlex.join(command)}\n{done.stderr}"


def test_random_decode_batches_post_what_the_python_path_posts(fill) -> None:
    """Two mirrors and two mails driven with the same batches, one through the C call first, one through the
    Python path alone: after every batch the published records and the mirrors are equal. The batches mix plain
    decode rows with every way out of the fast rule: a new request on a row, a retraction, a token rewritten in
    place, an output of one token, a row that is not an int (a float, a bool, a missing attribute), rows and starts
    outside the table, a negative row, a token that is not an int or does not fit int64, a request twice in one
    batch, a request gone (its weak reference dead), a full mail (the ring wraps)."""
    rng = random.Random(3)
    native_mail, native_header = _mail(capacity=48)
    python_mail, python_header = _mail(capacity=48)
    native_mirror: dict = {}
    python_mirror: dict = {}
    tokens = iter(range(100, 1 << 30))
    live = {row: Req(row, [next(tokens) for _ in range(rng.randint(1, 8))], []) for row in range(ROWS)}
    posted = refused = 0
    for step in range(1500):
        for row, req in list(live.items()):
            roll = rng.random()
            if roll < 0.992:
                req.output_ids.append(next(tokens))
            elif roll < 0.994 and req.output_ids:
                del req.output_ids[rng.randrange(len(req.output_ids)):]
            elif roll < 0.996 and req.output_ids:
                req.output_ids[-1] = next(tokens)
            elif roll < 0.998:
                live[row] = Req(row, [next(tokens) for _ in range(rng.randint(1, 8))], [])
        batch = list(live.values())
        if rng.random() < 0.2:
            batch = rng.sample(batch, rng.randint(1, len(batch)))
        odd = rng.random()
        if odd < 0.03:
            batch.append(batch[0])  # a request twice
        elif odd < 0.06:
            victim = rng.choice(batch)
            victim.output_ids.append(rng.choice([1.5, 1 << 70, -(1 << 70), "x"]))  # not an int64 token
        elif odd < 0.09:
            strange = Req(rng.choice([None, 3.0, True, -1, ROWS, ROWS + 5]), [1, 2], [3, 4])
            batch.insert(rng.randrange(len(batch) + 1), strange)
        elif odd < 0.1:
            rowless = Req(0, [1], [2, 3])
            del rowless.req_pool_idx  # (sglang's requests have one; the Python path passes over one without)
            batch.insert(rng.randrange(len(batch) + 1), rowless)
        if odd < 0.1 and step % 2:  # now and then a request the mirror knew, gone (a new one on its row)
            row = rng.randrange(ROWS)
            live[row] = Req(row, list(live[row].origin_input_ids), list(live[row].output_ids))
        # the device's read cursor moves now and then (by then the kernel applied those records)
        if rng.random() < 0.7:
            native_header[READ_AT] = native_mail.written
            python_header[READ_AT] = python_mail.written
        before = _mirror_state(python_mirror)
        assert before == _mirror_state(native_mirror)
        try:
            expect = _python_post(python_mail, python_mirror, batch)
        except Exception as exc:  # the Python path raises for this batch: so must the hook's (the C call refuses)
            assert native_mail.post_filled(len(batch), fill, batch, native_mirror, DECODE_NAMES) is False
            assert _mirror_state(native_mirror) == before
            with pytest.raises(type(exc)):
                _python_post(native_mail, native_mirror, batch)
            # each path raised part way through its columns: both mirrors are where the Python rule left them
            assert _mirror_state(native_mirror) == _mirror_state(python_mirror)
            refused += 1
        else:
            written = native_mail.written
            got = native_mail.post_filled(len(batch), fill, batch, native_mirror, DECODE_NAMES)
            if got:
                posted += 1
                assert expect, "the C call posted a batch the Python path did not"
            else:
                refused += 1
                assert native_mail.written == written and _mirror_state(native_mirror) == before
                assert _python_post(native_mail, native_mirror, batch) == expect
        for row in range(ROWS):  # the equal states of both (the Python path's rows are ints; any others left out)
            assert _mirror_state(native_mirror).get(row) == _mirror_state(python_mirror).get(row), (step, row)
        assert native_mail.written == python_mail.written and native_mail.posted == python_mail.posted
        assert _unread(native_mail, native_header) == _unread(python_mail, python_header), step
        assert int(native_mail.published[0]) == int(python_mail.published[0]) == native_mail.written
    assert posted > 700 and refused > 300, (posted, refused)


def _unread(mail: TokenMail, header: list[int]) -> list[list[int]]:
    """The published records the device has not read yet, oldest first: all a check launch reads (a refused C call
    may have written the slots after them, which the device read long ago and reads again only once published)."""
    records = mail.records.tolist()
    slots = [i % mail.capacity for i in range(header[READ_AT], mail.written)]
    return [[column[i] for i in slots] for column in records]


def _decoding(n: int, row0: int = 0) -> tuple[list[Req], dict]:
    """``n`` requests on rows ``row0..``, each sent all but its last token (a decode batch for the C call)."""
    reqs = [Req(row0 + i, [10 * i, 10 * i + 1], [10 * i + 2, 10 * i + 3]) for i in range(n)]
    mirror = {r.req_pool_idx: [weakref.ref(r), 3, r.output_ids[-2]] for r in reqs}
    return reqs, mirror


def test_a_refused_batch_leaves_the_mirror_as_it_was(fill) -> None:
    """A request that fails the rule after others passed (here the last, and a row twice whose second sight fails):
    -1, every entry put back (the same objects), nothing published."""
    mail, _ = _mail()
    reqs, mirror = _decoding(4)
    snapshot = {row: list(entry) for row, entry in mirror.items()}
    bad = Req(2, [1], [2])  # row 2's entry belongs to another request
    assert mail.post_filled(5, fill, [*reqs, bad], mirror, DECODE_NAMES) is False
    assert mail.written == 0 and mail.posted == 0 and mail.full == 0
    assert all(mirror[row] == entry and all(a is b for a, b in zip(mirror[row], entry, strict=True))
               for row, entry in snapshot.items())
    assert mail.post_filled(5, fill, [*reqs, reqs[1]], mirror, DECODE_NAMES) is False  # row 1 twice: once is all
    assert {row: list(entry) for row, entry in mirror.items()} == snapshot
    assert mail.post_filled(4, fill, reqs, mirror, DECODE_NAMES) is True
    assert mail.records[:, :4].tolist() == [[0, 1, 2, 3], [3, 3, 3, 3], [3, 13, 23, 33], [8, 8, 8, 8]]
    assert [mirror[row][1:] for row in range(4)] == [[4, 3], [4, 13], [4, 23], [4, 33]]


@pytest.mark.parametrize("case", ["two tokens more", "the token before rewritten", "another request", "gone",
                                  "one output token", "row as float", "sent not an int"])
def test_a_row_that_only_looks_like_a_decode_row_is_refused(fill, case) -> None:
    """Each condition of the rule alone: a row one of them fails is refused by the C call (the mirror untouched),
    and the Python path then sends what its rule says (not a one-token post)."""
    req = Req(1, [1, 2, 3], [7, 8])
    entry = [weakref.ref(req), 4, 7]  # sent 4 tokens, the last 7: a decode row now (8 at 4)
    keep = None
    if case == "two tokens more":
        req.origin_input_ids.append(4)  # 6 tokens, 4 sent: output[-2] is still the last sent
    elif case == "the token before rewritten":
        entry[2] = 6
    elif case == "another request":
        keep = Req(1, [1, 2, 3], [7])
        entry[0] = weakref.ref(keep)
    elif case == "gone":
        entry[0] = weakref.ref(Req(1, [], []))  # (dead at once)
    elif case == "one output token":
        req.origin_input_ids.append(7)
        req.output_ids = [8]
    elif case == "row as float":
        req.req_pool_idx = 1.0
    elif case == "sent not an int":
        entry[1] = 4.0
    mail, _ = _mail()
    mirror = {1: entry}
    snapshot = list(entry)
    assert mail.post_filled(1, fill, [req], mirror, DECODE_NAMES) is False
    assert mirror[1] == snapshot and mail.written == 0
    control = Req(1, [1, 2, 3], [7, 8])  # the same rule passes the plain decode row
    plain = {1: [weakref.ref(control), 4, 7]}
    assert mail.post_filled(1, fill, [control], plain, DECODE_NAMES) is True and plain[1][1:] == [5, 8]
    del keep


def test_python_code_a_request_runs_that_drops_its_mirror_entry_is_survived(fill) -> None:
    """A request whose ``output_ids`` is a property that drops the mirror's entries and the batch list's items while
    the call reads it (sglang's requests run no such code, but the call must not read freed memory if one did): the
    C call holds what it reads, and its outcome is the Python path's (the entry, dropped from the mirror, updated)."""

    class Meddling:
        def __init__(self, row: int, mirror: dict, batch: list) -> None:
            self.req_pool_idx, self.origin_input_ids, self._output = row, [1, 2], [3, 4]
            self._mirror, self._batch = mirror, batch

        @property
        def output_ids(self):
            self._mirror.clear()
            self._batch.clear()
            return self._output

    results = []
    for native in (True, False):
        mail, _ = _mail()
        mirror: dict = {}
        batch: list = []
        req = Meddling(5, mirror, batch)
        mirror[5] = [weakref.ref(req), 3, 3]  # (nothing else holds the entry: dropped from the mirror, it is freed)
        batch += [req, Req(6, [1], [2, 3])]
        posted = (mail.post_filled(2, fill, batch, mirror, DECODE_NAMES) if native
                  else _python_post(mail, mirror, list(batch)))
        results.append((posted, dict(mirror), mail.written))
    assert results[0] == (False, {}, 0)  # (the second request has no entry: not a decode row; nothing posted)
    assert results[1][1] == {6: results[1][1][6]}  # (the Python path sends row 6 whole: not a one-token post)


def test_rows_and_starts_outside_the_table_are_refused(fill) -> None:
    """The mail's bounds, as its Python post applies them: a row at or past the table's rows, a start at or past its
    width (the C call refuses the batch; the Python path's post then refuses it too and the upload clips it)."""
    mail, _ = _mail()
    for row, sent in ((ROWS, 3), (0, WIDTH)):
        req = Req(row, list(range(sent - 1)), [7, 8])
        mirror = {row: [weakref.ref(req), sent, 7]}
        assert mail.post_filled(1, fill, [req], mirror, DECODE_NAMES) is False and mirror[row][1:] == [sent, 7]
        assert _python_post(mail, mirror, [req]) is False and mirror[row][1:] == [sent + 1, 8]
    inside = Req(ROWS - 1, list(range(WIDTH - 2)), [7, 8])
    mirror = {ROWS - 1: [weakref.ref(inside), WIDTH - 1, 7]}
    assert mail.post_filled(1, fill, [inside], mirror, DECODE_NAMES) is True
    assert mail.records[:3, 0].tolist() == [ROWS - 1, WIDTH - 1, 8]


def test_records_wrap_at_the_ring_s_end_and_a_full_ring_is_not_called(fill) -> None:
    """Records past the ring's end continue at its start; a batch with no room is refused before the call (not
    counted in ``full``: the caller offers it to ``post``, which counts it)."""
    mail, header = _mail(capacity=6)
    first, mirror = _decoding(4)
    assert mail.post_filled(4, fill, first, mirror, DECODE_NAMES)
    second, more = _decoding(4, row0=4)
    calls = []

    def counting(*args):
        calls.append(args)
        return fill(*args)

    assert not mail.post_filled(4, counting, second, more, DECODE_NAMES) and calls == [] and mail.full == 0
    header[READ_AT] = 4  # the device read the first batch
    assert mail.post_filled(4, counting, second, more, DECODE_NAMES) and len(calls) == 1
    assert mail.records[0].tolist() == [6, 7, 2, 3, 4, 5]  # slots 4, 5 then 0, 1
    assert int(mail.published[0]) == 8


def test_bad_calls_raise_and_a_closed_mail_posts_nothing(fill) -> None:
    mail, _ = _mail()
    reqs, mirror = _decoding(2)
    columns = tuple(column.data_ptr() for column in mail.records)  # (rows, starts, tokens, steps)
    with pytest.raises(TypeError, match="mirror must be a dict"):
        fill(reqs, [], DECODE_NAMES, columns, 0, 8, ROWS, WIDTH, 1)
    with pytest.raises(TypeError, match="names"):
        fill(reqs, mirror, ("a", "b"), columns, 0, 8, ROWS, WIDTH, 1)
    with pytest.raises(TypeError, match="columns"):
        fill(reqs, mirror, DECODE_NAMES, columns[:3], 0, 8, ROWS, WIDTH, 1)
    with pytest.raises(ValueError, match="not a ring slot"):
        fill(reqs, mirror, DECODE_NAMES, columns, 8, 8, ROWS, WIDTH, 1)
    with pytest.raises(TypeError, match="9 arguments"):
        fill(reqs, mirror)
    closed = TokenMail(8, pinned=False)
    assert closed.post_filled(2, fill, reqs, mirror, DECODE_NAMES) is False and closed.written == 0


def test_a_missing_python_h_or_compiler_is_an_error_that_says_why(tmp_path, monkeypatch) -> None:
    """The build's failures name their cause; the adapter then logs it and keeps the Python path."""
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "x.c"
    source.write_text("int x;\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path / "none")})
    with pytest.raises(host_ext.HostExtError, match="no Python.h"):
        host_ext.build(source)
    monkeypatch.undo()
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(host_ext.HostExtError, match="false .* exited 1"):
        host_ext.build(source)
    assert not any((tmp_path / "cache").rglob("*.so*"))  # nothing half-built left to load


def test_the_adapter_logs_why_and_keeps_the_python_path(monkeypatch, caplog) -> None:
    def broken():
        raise host_ext.HostExtError("no Python.h in '/nowhere'")

    monkeypatch.setattr(host_ext, "decode_fill", broken)
    with caplog.at_level("WARNING", logger="kvcanary.sglang.tokens"):
        assert sglang_tokens.decode_fill() is None
    assert "Python path" in caplog.text and "no Python.h in '/nowhere'" in caplog.text


def test_the_build_is_cached_by_source_and_python(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    path = host_ext.build()
    assert path.parent.parent == tmp_path and path.name.endswith(sysconfig.get_config_var("EXT_SUFFIX"))
    stamp = path.stat().st_mtime_ns
    assert host_ext.build() == path and path.stat().st_mtime_ns == stamp  # found, not rebuilt
    copy = tmp_path / "other.c"
    copy.write_text(host_ext.SOURCE.read_text() + "\n/* changed */\n")
    assert host_ext.library_path(copy) != path
