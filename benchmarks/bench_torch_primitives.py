"""Host µs of the torch and kvcanary primitives the per-forward path is built from, on a CUDA host (issue 15).

What a stream lookup, an event record or query, a small copy or scatter and kvcanary's staging uploads cost on this
host, each timed alone (min over 5 rounds of 3000 calls, synchronised between rounds): the numbers behind choosing
one primitive over another (``kvcanary.runtime.streams.current_stream`` over ``torch.cuda.current_stream``, a zero-copy
upload over ``copy_`` + ``index_put_``, one status-copy segment or two). Prints a markdown table.

    PYTHONPATH=plugin python3 benchmarks/bench_torch_primitives.py
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Callable

import torch

CALLS = 3000
ROUNDS = 5


class NoEvent:
    """A staging event that is always complete: times an upload without its event (unsafe outside a benchmark)."""

    def record(self) -> None: ...

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...


def timed(name: str, fn: Callable[[], object]) -> None:
    """Print ``name``'s host µs per call: the best of ROUNDS rounds of CALLS calls, after a warm-up."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    print(f"| {name} | {best:.2f} |", flush=True)


def streams_and_events(dev: torch.device) -> None:
    from kvcanary.runtime.streams import current_stream

    index = dev.index
    timed("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
    timed("torch.cuda.current_stream()", torch.cuda.current_stream)
    timed("torch._C._cuda_getCurrentRawStream(index)", lambda: torch._C._cuda_getCurrentRawStream(index))
    timed("kvcanary.runtime.streams.current_stream(index)", lambda: current_stream(index))
    timed("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing)
    event = torch.cuda.Event()
    stream = torch.cuda.current_stream(dev)
    timed("event.record(stream), the stream object at hand", lambda: event.record(stream))
    timed("event.record()", event.record)
    timed("event.record(torch.cuda.current_stream(dev))", lambda: event.record(torch.cuda.current_stream(dev)))
    timed("event.record(kvcanary.runtime.streams.current_stream(index))", lambda: event.record(current_stream(index)))
    event.record(stream)
    torch.cuda.synchronize()
    timed("event.query(), completed", event.query)


def small_ops(dev: torch.device) -> None:
    x = torch.zeros(16, device=dev)
    timed("x.add_(1) (one torch launch)", lambda: x.add_(1))
    pinned = torch.zeros(4096, dtype=torch.int64, pin_memory=True)
    on_device = torch.zeros(4096, dtype=torch.int64, device=dev)
    host_view, device_view = pinned[:128], on_device[:128]
    timed("copy_ H2D, 128 int64 pinned, non_blocking", lambda: device_view.copy_(host_view, non_blocking=True))
    timed("copy_ D2H, 128 int64 to pinned, non_blocking", lambda: host_view.copy_(device_view, non_blocking=True))
    target = torch.zeros(1024, dtype=torch.int64, device=dev)
    rows, values = torch.arange(64, device=dev), torch.arange(64, device=dev)
    timed("index_put_, 64 values", lambda: target.index_put_((rows,), values))
    timed("index_copy_, 64 values", lambda: target.index_copy_(0, rows, values))
    timed("scatter_, 64 values", lambda: target.scatter_(0, rows, values))
    timed("tensor[:64] (a slice)", lambda: target[:64])
    padded = target[3:5]
    timed("zero_ of a prebuilt view", padded.zero_)
    staging = (struct.calcsize("q") * 384) * b"\0"
    buffer = bytearray(staging)
    values_384 = list(range(384))
    timed("struct.pack_into, 384 int64", lambda: struct.pack_into("384q", buffer, 0, *values_384))


def kvcanary_uploads(dev: torch.device) -> None:
    from kvcanary.runtime.pump import PinnedChannel
    from kvcanary.runtime.serial_upload import RowSerialUpload
    from kvcanary.runtime.token_table import TokenColumns, TokenTable

    decode = TokenColumns(list(range(64)), [100] * 64, [1] * 64, [[5] * 64])
    table = TokenTable(256, 4096, dev)
    timed("TokenTable.update, 64 decode rows (events)", lambda: table.update(decode))
    no_events = TokenTable(256, 4096, dev, event_factory=NoEvent, ring_size=8)
    timed("TokenTable.update, 64 decode rows (no events: the event's share)", lambda: no_events.update(decode))
    row_serials = torch.zeros(1024, dtype=torch.int64, device=dev)
    upload = RowSerialUpload(row_serials)
    rows, serials = list(range(64)), list(range(1000, 1064))
    timed("RowSerialUpload, 64 rows (events)", lambda: upload(rows, serials))
    upload_no_events = RowSerialUpload(row_serials, event_factory=NoEvent)
    timed("RowSerialUpload, 64 rows (no events)", lambda: upload_no_events(rows, serials))
    channel = PinnedChannel(2048, torch.int64, dev)
    header = torch.zeros(64, dtype=torch.int64, device=dev)
    meta = torch.zeros(32, dtype=torch.int64, device=dev)

    def status_copy(*segments: torch.Tensor) -> None:
        channel.start(*segments, step=1)
        channel.event.synchronize()
        channel.take()

    timed("PinnedChannel start + wait + take, 2 segments (the drain's status copy)", lambda: status_copy(header, meta))
    timed("PinnedChannel start + wait + take, 1 segment", lambda: status_copy(header))


def kvcanary_launches(dev: torch.device) -> None:
    """What one bound check or write call costs on this host, against tvm-ffi's own call floor (``testing.nop``
    with the same number of CUDA tensors: DLPack exchange + the stream query, no C++ wrapper, no launch), and whether
    the batch's size or a busy device moves a launch's host time (issue 25: the engine's eager launches measured
    ~2x the bench's)."""
    import tvm_ffi

    from kvcanary.kernels.batch import BatchView, ForwardKind
    from kvcanary.kernels.real_kv import RealKvSource
    from kvcanary.runtime.config import Config
    from kvcanary.runtime.manager import CanaryManager
    from kvcanary.settings import Mode

    nop = tvm_ffi.get_global_func("testing.nop")
    six = [torch.zeros(64, dtype=torch.int64, device=dev) for _ in range(6)]
    timed("tvm-ffi testing.nop(), no arguments", nop)
    timed("tvm-ffi testing.nop, 6 CUDA tensors + 2 ints (the bound check's call floor)", lambda: nop(*six, 1, 5))
    timed("tvm-ffi testing.nop, 3 CUDA tensors (the bound write's call floor)", lambda: nop(*six[:3]))
    slots, rows, ctx = 65536, 65, 1024
    r2t = torch.arange(rows * ctx, dtype=torch.int32, device=dev).reshape(rows, ctx) % (slots - 1) + 1
    kv = [torch.zeros((slots, 256), dtype=torch.uint8, device=dev) for _ in range(2)]
    mgr = CanaryManager(Config(mode=Mode.LOG, stats_every=0, health_window=1 << 30), num_slots=slots,
                        req_to_token=r2t, device=dev, max_batch_size=rows, max_tokens_per_forward=8192,
                        real_kv_sources=[RealKvSource(k, 1, 256, 256) for k in kv])
    mgr.mark_init_finished()
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    idle = BatchView(ForwardKind.IDLE, empty, empty, empty, empty, empty, empty)

    def decode(bs: int, context: int) -> BatchView:
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        rows_ = list(range(1, bs + 1))
        return BatchView(ForwardKind.DECODE, t([7] * bs), t([context] * bs), t([1 + r for r in rows_]), t(rows_),
                         t([context] * bs), t([1] * bs))

    fn = mgr.device_state.check_batch
    timed("bound check call, IDLE batch (C++ wrapper + launch, no entries)", lambda: fn(idle, 0, 5))
    one, wide = decode(1, 64), decode(64, 1000)
    timed("bound check call, decode bs 1 x 64 context", lambda: fn(one, 0, 5))
    timed("bound check call, decode bs 64 x 1000 context, back to back (device busy)", lambda: fn(wide, 0, 5))
    sync = torch.cuda.synchronize
    base = _per_call(sync)
    print(f"| bound check call, decode bs 64 x 1000 context, device idle (each call after a sync; sync's "
          f"{base:.2f} taken off) | {_per_call(lambda: (sync(), fn(wide, 0, 5))) - base:.2f} |", flush=True)
    timed("after_forward, decode bs 64 (the bound write)", lambda: mgr.after_forward(wide))


def _per_call(fn: Callable[[], object]) -> float:
    """Host µs of one ``fn()``: the best of ROUNDS rounds of CALLS // 10 calls."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(CALLS // 10):
            fn()
        best = min(best, (time.perf_counter() - t0) / (CALLS // 10) * 1e6)
    return best


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench_torch_primitives: needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"### host µs per call ({torch.cuda.get_device_name(dev)}, torch {torch.__version__})\n")
    print(f"| piece | µs per call (min of {ROUNDS} rounds x {CALLS}) |\n|---|---|")
    small_ops(dev)
    streams_and_events(dev)
    kvcanary_uploads(dev)
    kvcanary_launches(dev)


if __name__ == "__main__":
    main()
