#!/usr/bin/env python3
"""Host time of the canary's per-forward path, piece by piece (what a CPU-bound scheduler loop pays).

    python benchmarks/bench_host.py [--device cuda] [--iters 2000]

A small model's serving loop is bound by host time: every microsecond the canary spends launching kernels or
draining its status is a microsecond per forward. This times, on one device in one run, the manager's
``before_forward`` / ``after_forward`` (eager forwards: graph replays skip them) and ``step`` (every forward) in
the regime of a CPU-bound engine (the GPU idle, so each step reads and restarts the status copy), and their
parts, next to one empty torch launch (``x.add_(1)``) as the unit.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from kvcanary.kernels import call, layout
from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.runtime.config import Config
from kvcanary.runtime.manager import CanaryManager
from kvcanary.runtime.pump import PinnedChannel
from kvcanary.runtime.serial_upload import RowSerialUpload
from kvcanary.runtime.token_table import TOKEN_MAIL_CAPACITY, TokenMail
from kvcanary.settings import Mode


def timed(fn, iters: int, sync) -> float:
    """Median over 5 rounds of the mean host µs per call (device work is not waited for inside a round)."""
    rounds = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - t0) / iters * 1e6)
        sync()
    return sorted(rounds)[2]


class Recorder:
    """Stands in for the loaded kernel module while a manager is built and runs a forward: keeps each export's name and
    positional arguments; a ``*_bind`` export returns a function whose calls are kept as ``<bind name>()``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        def export(*args):
            self.calls.append((name, args))
            return lambda *call_args: self.calls.append((f"{name}()", call_args))

        return export


def recorded_calls(make_manager, batch: BatchView) -> list[tuple[str, tuple]]:
    """(export name, positional arguments) of every kernel call a manager built by ``make_manager`` makes while it is
    built and runs ``batch`` once (binds, then ``<bind name>()`` for each call of a bound function). The manager's
    launches bind their export when it is built, so the manager is built against a :class:`Recorder`."""
    recorder = Recorder()
    saved = call.load_module
    call.load_module = lambda backend: recorder  # type: ignore[assignment]
    try:
        mgr = make_manager()
        mgr.before_forward(batch)
        mgr.after_forward(batch)
    finally:
        call.load_module = saved
    return recorder.calls


HOST_CASE_SLOTS, HOST_CASE_ROWS, HOST_CASE_CONTEXT = 65536, 65, 4096


def host_case(dev: torch.device) -> tuple[Callable[[], CanaryManager], BatchView, torch.Tensor]:
    """(a factory of this bench's manager, its decode forward of batch 1, its req_to_token table): 65536 slots, 65 rows
    of 4096 tokens, four PARTIAL real-KV sources, log mode with no stats line; row 1 holds slots 1..4096."""
    slots, rows, ctx = HOST_CASE_SLOTS, HOST_CASE_ROWS, HOST_CASE_CONTEXT
    r2t = torch.zeros((rows, ctx), dtype=torch.int32, device=dev)
    r2t[1, :ctx] = torch.arange(1, ctx + 1, dtype=torch.int32, device=dev)
    kv = [torch.zeros((slots, 256), dtype=torch.uint8, device=dev) for _ in range(4)]
    # step() is timed without forwards: a window that never ends keeps health errors out of the step rows
    config = Config(mode=Mode.LOG, stats_every=0, health_window=1 << 30)

    def make_manager() -> CanaryManager:
        return CanaryManager(config, num_slots=slots, req_to_token=r2t, device=dev, max_batch_size=rows,
                             max_tokens_per_forward=8192, real_kv_sources=[RealKvSource(k, 1, 256, 256) for k in kv])

    t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    return make_manager, BatchView(ForwardKind.DECODE, t([7]), t([64]), t([65]), t([1]), t([64]), t([1])), r2t


def export_rows(make_manager, batch: BatchView, iters: int, sync) -> list[tuple[str, float]]:
    """Where a launch's host time goes: each tvm-ffi export (or, for a launch bound once, the function its
    ``*_bind`` export returned) called with the arguments the manager's launches pass, prebuilt (argument conversion
    + C++ checks + the CUDA launch), to set against the whole manager call."""
    module = call.load_module(batch.input_ids.device.type)
    bound = {}  # bind name -> the function it returned (binds run once per manager: not timed)
    rows = []
    for name, call_args in recorded_calls(make_manager, batch):
        if name.endswith("_bind"):
            bound[name] = getattr(module, name)(*call_args)
            continue
        fn = bound[name[:-2]] if name.endswith("()") else getattr(module, name)
        what = "the bound function alone" if name.endswith("()") else "the export alone"
        rows.append((f"{name}: {what}, {len(call_args)} arguments prebuilt",
                     timed(functools.partial(fn, *call_args), iters, sync)))
    return rows


def decode_staging(seqs: dict[int, list[int]], dev: torch.device) -> tuple[torch.Tensor, int, int]:
    """(staging, num_updates, staged_len) of each row's last token, laid out as TokenTable stages it (pinned on
    CUDA); its values never change, so relaunching it needs no ring."""
    n = len(seqs)
    fields = [0] * layout.TOKEN_UPDATE_FIELDS
    fields[layout.TOKEN_UPDATE_FIELD_ROW] = list(seqs)
    fields[layout.TOKEN_UPDATE_FIELD_START] = [len(t) - 1 for t in seqs.values()]
    fields[layout.TOKEN_UPDATE_FIELD_COUNT] = [1] * n
    fields[layout.TOKEN_UPDATE_FIELD_VALID_LEN] = [len(t) for t in seqs.values()]
    first_token = layout.TOKEN_UPDATE_FIELDS * n
    fields[layout.TOKEN_UPDATE_FIELD_OFFSET] = list(range(first_token, first_token + n))
    values = [v for field in fields for v in field] + [t[-1] for t in seqs.values()]
    staging = torch.tensor(values, dtype=torch.int64)
    return (staging.pin_memory() if dev.type == "cuda" else staging), n, len(values)


def append_staging(seqs: dict[int, list[int]], dev: torch.device) -> tuple[torch.Tensor, int]:
    """(staging, num_updates) of each row's last token as TokenTable stages a decode batch for canary_token_append
    (rows, starts, tokens; pinned on CUDA); its values never change, so relaunching it needs no ring."""
    fields = [[]] * layout.TOKEN_APPEND_FIELDS
    fields[layout.TOKEN_APPEND_FIELD_ROW] = list(seqs)
    fields[layout.TOKEN_APPEND_FIELD_START] = [len(t) - 1 for t in seqs.values()]
    fields[layout.TOKEN_APPEND_FIELD_TOKEN] = [t[-1] for t in seqs.values()]
    staging = torch.tensor([v for field in fields for v in field], dtype=torch.int64)
    return (staging.pin_memory() if dev.type == "cuda" else staging), len(seqs)


def bound_append(tok: CanaryManager, seqs: dict[int, list[int]], dev: torch.device) -> Callable[[], None]:
    """The bound append of :func:`append_staging`'s staging (``canary_token_append_bind``), as one call."""
    table = tok.token_table
    assert table is not None
    staging, n = append_staging(seqs, dev)
    bound = call.load_module(dev.type).canary_token_append_bind(table.expected_tokens, table.valid_lens_by_row, staging)
    return functools.partial(bound, table.valid_lens_by_row, n)


def mail_post(rows_: list[int], starts: list[int], tokens: list[int], rows: int,
              dev: torch.device) -> Callable[[], None]:
    """One TokenMail.post of a decode batch, the device's read cursor moved to what was written before each (as a
    device that keeps up leaves it): the host's whole cost of a decode batch's upload with the token mail."""
    mail = TokenMail(TOKEN_MAIL_CAPACITY, pinned=dev.type == "cuda")
    header = [0] * layout.STATE_HEADER_FIELDS

    class Steps:
        steps = 0

    mail.open(header, Steps, rows, 1 << 20)

    def post() -> None:
        header[layout.STATE_TOKEN_MAIL_READ] = mail.written
        mail.post(rows_, starts, tokens)

    return post


def serial_staging(rows: list[int], serials: list[int], dev: torch.device) -> torch.Tensor:
    """The rows then the serials, as RowSerialUpload stages them (pinned on CUDA); never rewritten, so relaunching it
    needs no ring."""
    staging = torch.tensor(rows + serials, dtype=torch.int64)
    return staging.pin_memory() if dev.type == "cuda" else staging


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    make_manager, decode, r2t = host_case(dev)
    slots, rows = HOST_CASE_SLOTS, HOST_CASE_ROWS
    mgr = make_manager()
    mgr.mark_init_finished()
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    extend = BatchView(ForwardKind.EXTEND, t([7] * 256), t(list(range(64, 320))), t(list(range(65, 321))), t([1]),
                       t([64]), t([256]))
    mgr.before_forward(prefill := BatchView(ForwardKind.EXTEND, t([7] * 64), t(list(range(64))),
                                            t(list(range(1, 65))), t([1]), t([0]), t([64])))
    mgr.after_forward(prefill)  # the records every later verify reads: the benchmark must stay violation-free
    x = torch.zeros(1, device=dev)
    for view in (decode, extend):  # warm: the build, the allocator, the channels
        for _ in range(20):
            mgr.before_forward(view)
            mgr.after_forward(view)
            mgr.step()
    sync()

    def step_idle() -> None:  # the CPU-bound engine: the device finished before the host gets here
        sync()
        mgr.step()

    sync_us = timed(sync, args.iters, sync)
    channel = PinnedChannel(272, torch.int64, dev)  # the drain's (copies on the compute stream)
    rows_out = [
        ("one torch launch (x.add_(1))", timed(lambda: x.add_(1), args.iters, sync)),
        ("before_forward (decode bs=1: one check launch)",
         timed(lambda: mgr.before_forward(decode), args.iters, sync)),
        ("after_forward (decode bs=1: write)", timed(lambda: mgr.after_forward(decode), args.iters, sync)),
        *export_rows(make_manager, decode, args.iters, sync),
        ("before_forward (extend 256)", timed(lambda: mgr.before_forward(extend), args.iters, sync)),
        ("after_forward (extend 256)", timed(lambda: mgr.after_forward(extend), args.iters, sync)),
        ("step, device idle (reads + restarts the status copy)", timed(step_idle, args.iters, sync) - sync_us),
        ("step, device busy (back to back)", timed(mgr.step, args.iters, sync)),
        ("status copy start (PinnedChannel.start, 2 KiB, compute stream)",
         timed(lambda: (channel.start(mgr.device_state.state[:272], step=0), setattr(channel, "busy", False)),
               args.iters, sync)),
    ]
    # token check (KVCANARY_VERIFY_TOKENS): a decode forward of 64 rows with ~1000-token requests
    tok = CanaryManager(Config(mode=Mode.LOG, stats_every=0, verify_tokens=True), num_slots=slots,
                        req_to_token=r2t, device=dev, max_batch_size=rows, max_tokens_per_forward=8192)
    seqs = {row: list(range(1000 + row)) for row in range(1, rows)}
    decode_rows, decode_starts = list(seqs), [len(t) - 1 for t in seqs.values()]
    decode_tokens, decode_counts = [t[-1] for t in seqs.values()], [1] * len(seqs)
    rows_out += [
        ("token table, 64 rows re-sent in full (set_expected_tokens each)",
         timed(lambda: [tok.set_expected_tokens(r, t) for r, t in seqs.items()], max(args.iters // 50, 5), sync)),
        ("token table, 64 rows' new token in one update (update_expected_tokens)",
         timed(lambda: tok.update_expected_tokens([(r, len(t) - 1, t[-1:]) for r, t in seqs.items()]),
               args.iters, sync)),
        ("token table, 64 rows' first ~1000 tokens in one update (a prefill batch's upload)",
         timed(lambda: tok.update_expected_tokens([(r, 0, t) for r, t in seqs.items()]),
               max(args.iters // 50, 5), sync)),
        ("canary_token_update: the export alone, the decode update's staging prebuilt",
         timed(functools.partial(call.load_module(dev.type).canary_token_update, tok.token_table.expected_tokens,
                                 tok.token_table.valid_lens_by_row, *decode_staging(seqs, dev)), args.iters, sync)),
        ("canary_token_append: the export alone, the decode update's staging prebuilt",
         timed(functools.partial(call.load_module(dev.type).canary_token_append, tok.token_table.expected_tokens,
                                 tok.token_table.valid_lens_by_row, *append_staging(seqs, dev)), args.iters, sync)),
        ("canary_token_append_bind: the bound append alone, its staging prebuilt (what a decode batch runs)",
         timed(bound_append(tok, seqs, dev), args.iters, sync)),
        ("token table, 64 rows' new token as the batch hook sends it (update_columns)",
         timed(lambda: tok.token_table.update_columns(decode_rows, decode_starts, decode_counts, [decode_tokens]),
               args.iters, sync)),
        ("token mail, 64 rows' new token posted (TokenMail.post; no launch, the device keeping up)",
         timed(mail_post(decode_rows, decode_starts, decode_tokens, rows, dev), args.iters, sync)),
    ]
    # writer attribution: a prefill batch of 64 new requests uploads their rows' serials
    serial_rows = list(range(1, rows))
    serials = list(range(1000, 1000 + len(serial_rows)))
    row_serials = torch.full((rows,), layout.META_UNKNOWN, dtype=torch.int64, device=dev)
    serial_upload = RowSerialUpload(row_serials)
    rows_out += [
        ("row-serial upload, 64 rows (RowSerialUpload: a prefill batch's writer serials)",
         timed(lambda: serial_upload(serial_rows, serials), args.iters, sync)),
        ("canary_row_serial_update: the export alone, the 64 rows' staging prebuilt",
         timed(functools.partial(call.load_module(dev.type).canary_row_serial_update, row_serials,
                                 serial_staging(serial_rows, serials, dev), len(serial_rows)), args.iters, sync)),
    ]
    mgr.flush()
    if mgr.reporter.total_reported:
        raise SystemExit(f"bench_host: {mgr.reporter.total_reported} violations: the synthetic forwards are wrong")
    unit = rows_out[0][1]
    print(f"### kvcanary host time per call ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__})\n")
    print("| piece | host µs per call | torch launches |\n|---|---|---|")
    for name, us in rows_out:
        print(f"| {name} | {us:.1f} | {us / unit:.1f} |")


if __name__ == "__main__":
    main()
