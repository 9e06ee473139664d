"""The batch hook's token uploads through a real Installation (issue 25: the hook calls the token table's
``update_columns`` directly, with no TokenColumns, Installation or manager call in between, and remembers each
forward mode's writer-attribution verdict): after every batch each group's table holds every request's tokens,
whatever the batch did to its rows (decode, retraction, abort and reuse of the row, chunked prefill, a token
rewritten in place); writer attribution still runs exactly for the batches that can bring new requests."""

from __future__ import annotations

import importlib.util
import random
import types

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

from kvcanary.runtime.config import Config  # noqa: E402
from kvcanary.runtime.installation import Group, GroupSpec, Installation  # noqa: E402
from kvcanary.runtime.manager import CanaryManager  # noqa: E402
from kvcanary.settings import Mode  # noqa: E402
from kvcanary.sglang import hooks as adapter_hooks  # noqa: E402
from kvcanary.sglang import installed, v0_5_12  # noqa: E402

ROWS, WIDTH = 12, 400


class Req:
    """sglang's Req: the fields the batch hook reads (a plain class: weak references work as on sglang's)."""

    def __init__(self, rid: str, row: int | None, origin: list[int], output: list[int]) -> None:
        self.rid, self.req_pool_idx, self.origin_input_ids, self.output_ids = rid, row, origin, output


def _installation(groups: int, verify_tokens: bool = True) -> Installation:
    cfg = Config(mode=Mode.RAISE, stats_every=0, verify_tokens=verify_tokens)
    r2t = torch.zeros((ROWS, WIDTH), dtype=torch.int32)
    specs = [GroupSpec(f"g{i}", 64, ()) for i in range(groups)]
    return Installation(config=cfg, groups=[
        Group(spec, CanaryManager(cfg, num_slots=64, req_to_token=r2t, device="cpu", max_batch_size=ROWS,
                                  max_tokens_per_forward=64)) for spec in specs],
        to_views=lambda *a: [], req_to_token=r2t)


def _runner(inst: Installation) -> types.SimpleNamespace:
    """A ModelRunner with ``inst`` installed, its RunnerState as AdapterHooks.install builds it."""
    state = installed.RunnerState(inst, token_upload=inst.expected_token_upload())
    return types.SimpleNamespace(**{installed.INSTALL_ATTR: inst, installed.RUNNER_STATE_ATTR: state})


def test_one_group_uploads_through_its_tables_own_call() -> None:
    """One group: the hook's upload is the table's update_columns itself (no installation or manager frame per
    batch); no token check: nothing to call."""
    inst = _installation(1)
    table = inst.groups[0].manager.token_table
    assert table is not None and inst.expected_token_upload() == table.update_columns
    assert _installation(1, verify_tokens=False).expected_token_upload() is None


@pytest.mark.parametrize("groups", [1, 2])
def test_every_batch_leaves_every_request_s_tokens_in_every_table(groups: int) -> None:
    """Random serving through the batch hook: decode steps (the one-token path), retractions (rolled back and
    decoded again), aborted requests whose row is reused by a new request (now and then with the same tokens),
    chunked prefills and lagging rows (nothing new), a sent token rewritten in place (the row is sent whole
    again: the token check must never keep the old token), a request twice in a batch. After every batch, each
    group's table holds each batch request's tokens up to its length."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rng = random.Random(11)
    inst = _installation(groups)
    runner = _runner(inst)
    hooks = adapter_hooks.AdapterHooks(v0_5_12)
    serial = 0
    # Every token decoded, re-decoded or rewritten is one not seen before: the rule re-sends a row when the last
    # token sent no longer matches, so a rewrite that lands on the very token it replaced is no rewrite to it
    fresh_tokens = iter(range(100, 1 << 30))

    def new_request(row: int, tokens: list[int] | None = None) -> Req:
        nonlocal serial
        serial += 1
        return Req(f"r{serial}", row, tokens or [next(fresh_tokens) for _ in range(rng.randint(1, 40))], [])

    reqs = {r: new_request(r) for r in range(1, ROWS)}
    decoded = rewritten = 0
    for _ in range(300):
        fresh = False
        for r, req in reqs.items():
            roll = rng.random()
            if roll < 0.65:
                req.output_ids.append(next(fresh_tokens))  # decode
                decoded += 1
            elif roll < 0.72 and req.output_ids:
                del req.output_ids[rng.randrange(len(req.output_ids)):]  # retraction, then decoded again
                req.output_ids += [next(fresh_tokens) for _ in range(rng.randint(0, 3))]
            elif roll < 0.76 and req.output_ids:
                req.output_ids[-1] = next(fresh_tokens)  # the last token (maybe sent already), rewritten in place
                rewritten += 1
            elif roll < 0.82:  # finished or aborted: the row's next request (now and then the same tokens)
                same = rng.random() < 0.3
                reqs[r] = new_request(r, req.origin_input_ids + req.output_ids if same else None)
                fresh = True
            # else: a chunked prefill or a lagging row, nothing new
        batch = rng.sample(list(reqs.values()), rng.randint(1, ROWS - 1))
        batch += rng.sample(batch, min(len(batch), rng.randint(0, 1)))  # a request twice in a batch
        mode = (ForwardMode.MIXED if rng.random() < 0.5 else ForwardMode.EXTEND) if fresh else ForwardMode.DECODE
        fb = types.SimpleNamespace(forward_mode=mode, reqs=batch)
        assert hooks.after_forward_batch_init("result", None, fb, runner) == "result"
        for group in inst.groups:
            table = group.manager.token_table
            for req in batch:
                tokens = req.origin_input_ids + req.output_ids
                assert int(table.valid_lens_by_row[req.req_pool_idx]) == len(tokens)
                assert table.expected_tokens[req.req_pool_idx, : len(tokens)].tolist() == tokens
    assert inst.stopped is None and inst.host_time.batch_inits == 300
    assert decoded > 1000 and rewritten > 50


def test_writer_attribution_follows_each_batch_s_mode_on_one_hooks_object() -> None:
    """The hook remembers each ForwardMode member's verdict: alternating modes on one AdapterHooks attribute
    exactly the prefill batches (EXTEND, MIXED), and a mode that is not an enum member (not remembered) is asked
    by its name every time."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    calls = []
    manager = types.SimpleNamespace(assign_requests=lambda rows, rids: calls.append(rows))
    inst = types.SimpleNamespace(stopped=None, groups=[types.SimpleNamespace(manager=manager)],
                                 account_batch_init=lambda ns: None)
    state = installed.RunnerState(inst)  # (no token check)
    runner = types.SimpleNamespace(**{installed.INSTALL_ATTR: inst, installed.RUNNER_STATE_ATTR: state})
    hooks = adapter_hooks.AdapterHooks(v0_5_12)
    named = [types.SimpleNamespace(name="EXTEND"), types.SimpleNamespace(name="DECODE")]
    modes = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE,
             named[0], named[1], ForwardMode.EXTEND, named[1], named[0]]
    for i, mode in enumerate(modes):
        batch = types.SimpleNamespace(forward_mode=mode, reqs=[types.SimpleNamespace(req_pool_idx=i, rid=f"r{i}")])
        assert hooks.after_forward_batch_init("result", None, batch, runner) == "result"
    assert calls == [[0], [3], [5], [7], [9]]


def _mail_installation() -> Installation:
    """One group whose token table has the token mail, open (what the adapter builds for a plain runner)."""
    cfg = Config(mode=Mode.RAISE, stats_every=0, verify_tokens=True)
    r2t = torch.zeros((ROWS, WIDTH), dtype=torch.int32)
    manager = CanaryManager(cfg, num_slots=64, req_to_token=r2t, device="cpu", max_batch_size=ROWS,
                            max_tokens_per_forward=64, token_mail=True)
    return Installation(config=cfg, groups=[Group(GroupSpec("g0", 64, ()), manager)], to_views=lambda *a: [],
                        req_to_token=r2t)


@pytest.mark.parametrize("native", [False, True], ids=["python", "host extension"])
def test_a_decode_batch_is_posted_to_the_mail_with_no_upload_call(native: bool, monkeypatch) -> None:
    """With the token mail, a decode batch (one token per row) goes from the hook straight to the mail (no
    ``update_columns`` frame per batch: issue 25): through the mail's post of the Python columns, or, with the host
    extension, read and posted by one C call with no Python columns built; either way as the records the upload
    would have posted. Any other batch (a prompt, a retraction's re-send) is uploaded as before. Random serving,
    checked batch by batch against the columns a second mirror gives for the same requests."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from kvcanary.sglang.tokens import decode_fill, expected_token_columns

    rng = random.Random(5)
    inst = _mail_installation()
    mail = inst.groups[0].manager.token_table.mail
    assert mail is not None and mail.is_open and inst.expected_token_post() == mail.post
    assert inst.expected_token_post_filled() == mail.post_filled
    uploads = []
    fill = decode_fill() if native else None
    assert (fill is not None) == native
    state = installed.RunnerState(inst, token_upload=lambda *columns: uploads.append(columns),
                                  token_post=inst.expected_token_post(),
                                  token_post_filled=inst.expected_token_post_filled() if native else None,
                                  token_fill=fill)
    python_columns = []

    def counted_columns(mirror, reqs):
        python_columns.append(len(reqs))
        return expected_token_columns(mirror, reqs)

    monkeypatch.setattr(adapter_hooks, "expected_token_columns", counted_columns)
    runner = types.SimpleNamespace(**{installed.INSTALL_ATTR: inst, installed.RUNNER_STATE_ATTR: state})
    hooks = adapter_hooks.AdapterHooks(v0_5_12)
    shadow: dict = {}
    tokens = iter(range(100, 1 << 30))
    reqs = {r: Req(f"r{r}", r, [next(tokens) for _ in range(rng.randint(1, 40))], []) for r in range(1, ROWS)}
    posted_batches = uploaded_batches = native_batches = 0
    for _ in range(200):
        for req in reqs.values():
            if rng.random() < 0.97:
                req.output_ids.append(next(tokens))
            elif req.output_ids:
                del req.output_ids[-1:]  # a retraction: the row is sent again from where it differs
        # every running request (a decode batch), now and then a part of them (those left out gain several tokens)
        running = list(reqs.values())
        batch = running if rng.random() < 0.85 else rng.sample(running, rng.randint(1, ROWS - 1))
        rows, starts, counts, runs = expected_token_columns(shadow, batch)
        written, before = mail.written, len(uploads)
        fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=batch)
        python_columns.clear()
        assert hooks.after_forward_batch_init("result", None, fb, runner) == "result"
        if rows and counts == [1] * len(rows):
            posted_batches += 1
            # the C call read the requests (a row's first output token takes the Python path: its rule reads the
            # token before it, output[-2])
            if not native or any(len(req.output_ids) < 2 for req in batch):
                assert python_columns == [len(batch)]
            else:
                assert python_columns == []
                native_batches += 1
            assert len(uploads) == before and mail.written == written + len(rows)
            records = mail.records[:3, written:written + len(rows)].tolist()
            assert records == [rows, starts, runs[0]]
        else:
            uploaded_batches += 1
            assert mail.written == written and uploads[before:] == [(rows, starts, counts, runs)]
    assert inst.stopped is None and posted_batches > 100 and uploaded_batches > 10
    assert native_batches > 100 if native else native_batches == 0


def test_only_one_group_with_an_open_mail_posts_decode_batches() -> None:
    """The mail's post and post_filled (the C decode post) are offered only where one group's table has the mail:
    not without the token check, not for a table without the mail (an EAGLE pool's: its appends are launched), not
    for several groups (each table would need the batch: they take the upload, which reaches every table)."""
    with_mail = _mail_installation()
    mail = with_mail.groups[0].manager.token_table.mail
    assert with_mail.expected_token_post() == mail.post and with_mail.expected_token_post_filled() == mail.post_filled
    for inst in (_installation(1), _installation(2), _installation(1, verify_tokens=False)):
        assert inst.expected_token_post() is None and inst.expected_token_post_filled() is None
    cfg = Config(mode=Mode.RAISE, stats_every=0, verify_tokens=True)
    r2t = torch.zeros((ROWS, WIDTH), dtype=torch.int32)
    two_with_mail = Installation(config=cfg, groups=[
        Group(GroupSpec(f"g{i}", 64, ()), CanaryManager(cfg, num_slots=64, req_to_token=r2t, device="cpu",
                                                         max_batch_size=ROWS, max_tokens_per_forward=64,
                                                         token_mail=True)) for i in range(2)],
        to_views=lambda *a: [], req_to_token=r2t)
    assert two_with_mail.expected_token_post() is None and two_with_mail.expected_token_post_filled() is None


def test_a_post_the_mail_refuses_is_uploaded() -> None:
    """A decode batch the mail does not take (full, closed, a row outside the table: ``post`` says False) is sent
    through the upload, which launches it: nothing is lost."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    posts, uploads = [], []
    inst = _installation(1)

    def refusing_post(rows, starts, tokens) -> bool:
        posts.append((list(rows), list(starts), list(tokens)))
        return False

    state = installed.RunnerState(inst, token_upload=lambda *columns: uploads.append(columns), token_post=refusing_post)
    runner = types.SimpleNamespace(**{installed.INSTALL_ATTR: inst, installed.RUNNER_STATE_ATTR: state})
    hooks = adapter_hooks.AdapterHooks(v0_5_12)
    reqs = [Req("a", 1, [5, 6, 7], []), Req("b", 2, [8, 9], [])]
    prefill = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs)
    hooks.after_forward_batch_init(None, None, prefill, runner)
    assert posts == [] and uploads == [([1, 2], [0, 0], [3, 2], [[5, 6, 7, 8, 9]])]
    for req, token in zip(reqs, (10, 11), strict=True):
        req.output_ids.append(token)
    decode = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=reqs)
    hooks.after_forward_batch_init(None, None, decode, runner)
    assert posts == [([1, 2], [3, 2], [10, 11])]
    assert uploads[1:] == [([1, 2], [3, 2], [1, 1], [[10, 11]])]


@pytest.mark.parametrize("native", [False, True], ids=["python", "host extension"])
def test_a_decode_batch_a_full_mail_refuses_is_launched(native: bool, monkeypatch) -> None:
    """A real mail with no room (no check launch has read it): the hook's post is refused, the batch goes through
    ``update_columns``, which offers it once more (refused again: ``full`` counts both posts) and launches it. The
    table holds the batch's tokens at once (the CPU launch), nothing is lost, and the records the mail took before
    are still waiting for their check launch."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from kvcanary.runtime import token_table

    monkeypatch.setattr(token_table, "TOKEN_MAIL_CAPACITY", 4)
    inst = _mail_installation()
    table = inst.groups[0].manager.token_table
    mail = table.mail
    assert mail is not None and mail.capacity == 4
    runner = _runner(inst)
    runner_state = getattr(runner, installed.RUNNER_STATE_ATTR)
    runner_state.token_post = inst.expected_token_post()
    if native:  # (the C call is not made without room, and its refusal is not counted: full counts 2 either way)
        from kvcanary.sglang.tokens import decode_fill

        runner_state.token_post_filled, runner_state.token_fill = inst.expected_token_post_filled(), decode_fill()
    hooks = adapter_hooks.AdapterHooks(v0_5_12)
    reqs = [Req("a", 1, [5, 6, 7], []), Req("b", 2, [8, 9], []), Req("c", 3, [4], [])]
    hooks.after_forward_batch_init(None, None, types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs),
                                   runner)  # the prompts: uploaded (launched)
    decode = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=reqs)
    for token in (20, 30):
        for req in reqs:
            req.output_ids.append(token + req.req_pool_idx)
        hooks.after_forward_batch_init(None, None, decode, runner)
    assert mail.posted == 1 and mail.written == 3 and mail.full == 2  # the second batch: refused twice, launched
    for req in reqs:  # the launched batch's tokens are in; the mailed one's wait for a check launch
        row = req.req_pool_idx
        tokens = req.origin_input_ids + req.output_ids
        assert int(table.valid_lens_by_row[row]) == len(tokens)
        assert table.expected_tokens[row, len(tokens) - 1].item() == tokens[-1]
    assert mail.records[:3, :3].tolist() == [[1, 2, 3], [3, 2, 1], [21, 22, 23]]
