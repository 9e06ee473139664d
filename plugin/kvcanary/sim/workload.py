"""A synthetic decode workload that drives a CanaryManager the way a serving engine does.

``DecodeRig`` prefills ``batch_size`` requests of ``context_len`` tokens (eager EXTEND forwards), then
runs decode forwards: the engine's per-step preparation (new slot, position, req_to_token entry) runs as
device ops outside the graph, and the forward (canary plan + verify, a stand-in "model" that writes the
KV bytes of the new slots, canary write) is captured once in a CUDA graph and replayed. Used by the GPU
tests and by ``benchmarks/bench_manager.py`` to measure the canary's per-forward overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.runtime.config import Config
from kvcanary.runtime.manager import CanaryManager

PREFILL_TOKENS_PER_FORWARD = 1 << 16


@dataclass(frozen=True)
class RigShape:
    batch_size: int
    context_len: int
    decode_steps: int
    kv_row_bytes: int = 256

    @property
    def max_len(self) -> int:
        return self.context_len + self.decode_steps

    @property
    def num_slots(self) -> int:
        return self.batch_size * self.max_len + 1  # slot 0: padding


class DecodeRig:
    """Requests in req_to_token rows 1..batch_size, slots a random permutation of the pool."""

    def __init__(self, shape: RigShape, config: Config | None, device: torch.device | str, *, seed: int = 0) -> None:
        self.shape = shape
        self.device = torch.device(device)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        bs, max_len = shape.batch_size, shape.max_len
        self.kv = torch.zeros((shape.num_slots, shape.kv_row_bytes), dtype=torch.uint8, device=self.device)
        self.req_to_token = torch.zeros((bs + 1, max_len), dtype=torch.int32, device=self.device)
        perm = torch.randperm(shape.num_slots - 1, generator=gen) + 1
        self.slot_table = perm.view(bs, max_len).t().contiguous().to(self.device)  # [pos, request]
        self.token_table = torch.randint(0, 50000, (max_len, bs), generator=gen).to(self.device)
        self.pattern = torch.arange(shape.kv_row_bytes, device=self.device, dtype=torch.int64)
        self.manager: CanaryManager | None = None
        if config is not None:
            self.manager = CanaryManager(
                config,
                num_slots=shape.num_slots,
                req_to_token=self.req_to_token,
                device=self.device,
                max_batch_size=max(bs, 1),
                max_tokens_per_forward=max(bs, min(PREFILL_TOKENS_PER_FORWARD, bs * shape.context_len)),
                real_kv_sources=[RealKvSource(self.kv, 1, shape.kv_row_bytes, shape.kv_row_bytes)],
            )
        rows = torch.arange(1, bs + 1, dtype=torch.int64, device=self.device)
        i64 = {"dtype": torch.int64, "device": self.device}
        self.decode = BatchView(
            kind=ForwardKind.DECODE,
            input_ids=torch.zeros(bs, **i64),
            positions=torch.full((bs,), shape.context_len - 1, **i64),
            out_cache_loc=torch.zeros(bs, **i64),
            req_pool_indices=rows,
            prefix_lens=torch.full((bs,), shape.context_len - 1, **i64),
            extend_lens=torch.ones(bs, **i64),
        )
        self.rows = rows
        self.graph: torch.cuda.CUDAGraph | None = None
        self.step_index = 0

    # ---------------------------------------------------------------------------------------- the "model"
    def write_kv(self, out_cache_loc: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Stand-in model: the KV bytes of a slot are a function of the token written there."""
        values = ((input_ids[:, None] * 131 + self.pattern[None, :]) % 251).to(torch.uint8)
        self.kv.index_copy_(0, out_cache_loc, values)

    def forward_body(self, batch: BatchView) -> None:
        if self.manager is not None:
            self.manager.before_forward(batch)
        self.write_kv(batch.out_cache_loc, batch.input_ids)
        if self.manager is not None:
            self.manager.after_forward(batch)

    # ---------------------------------------------------------------------------------------- prefill
    def prefill(self) -> None:
        """Eager EXTEND forwards for positions [0, context_len - 1); the last prompt token is the first decode."""
        bs, n = self.shape.batch_size, self.shape.context_len - 1
        per_forward = max(1, PREFILL_TOKENS_PER_FORWARD // max(n, 1))
        i64 = {"dtype": torch.int64, "device": self.device}
        for start in range(0, bs, per_forward):
            reqs = torch.arange(start, min(bs, start + per_forward), device=self.device)
            slots = self.slot_table[:n, reqs].t().reshape(-1)
            tokens = self.token_table[:n, reqs].t().reshape(-1)
            positions = torch.arange(n, **i64).repeat(reqs.numel())
            self.req_to_token[reqs + 1, :n] = self.slot_table[:n, reqs].t().to(torch.int32)
            batch = BatchView(
                ForwardKind.EXTEND, tokens, positions, slots, (reqs + 1).to(torch.int64),
                torch.zeros(reqs.numel(), **i64), torch.full((reqs.numel(),), n, **i64),
            )
            self.forward_body(batch)
            if self.manager is not None:
                self.manager.step()

    # ---------------------------------------------------------------------------------------- decode
    def prepare_decode(self) -> None:
        """Engine-side preparation of the next decode forward: device ops only, outside the graph."""
        d = self.decode
        pos = self.shape.context_len - 1 + self.step_index
        if pos >= self.shape.max_len:
            raise RuntimeError("DecodeRig: out of decode steps; build the rig with more decode_steps")
        d.positions.fill_(pos)
        d.prefix_lens.fill_(pos)
        d.out_cache_loc.copy_(self.slot_table[pos])
        d.input_ids.copy_(self.token_table[pos])
        self.req_to_token[:, pos].index_copy_(0, self.rows, d.out_cache_loc.to(torch.int32))
        self.step_index += 1

    def capture(self) -> None:
        """Capture one decode forward (warmed up eagerly first, on a side stream as torch requires)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        saved = (self.kv.clone(), None if self.manager is None else self.manager.canary_buf.clone())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward_body(self.decode)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.forward_body(self.decode)
        # The warmup wrote records and KV for the current decode slots; the first replay rewrites them.
        self.kv.copy_(saved[0])
        if self.manager is not None and saved[1] is not None:
            self.manager.canary_buf.copy_(saved[1])

    def decode_step(self) -> None:
        """One decode forward: prepare, replay (or run eagerly without a graph), host step."""
        self.prepare_decode()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.forward_body(self.decode)
        if self.manager is not None:
            self.manager.step()
