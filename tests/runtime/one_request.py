"""A CanaryManager on CPU driven by hand: one request in req_to_token row 1 (shared by the report tests)."""

from __future__ import annotations

import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.report import Violation
from kvcanary.runtime.config import Config
from kvcanary.runtime.manager import CanaryManager
from kvcanary.settings import Mode


class OneRequest:
    """One request in req_to_token row 1 on CPU; KV bytes = f(token, position); drains every forward."""

    def __init__(self, mode: Mode, report: str | None = None, **config: object) -> None:
        self.req_to_token = torch.zeros((2, 64), dtype=torch.int32)
        self.kv = torch.zeros((128, 32), dtype=torch.uint8)
        self.length = 0
        self.mgr = CanaryManager(
            Config(mode=mode, report_path=report, **{"drain_every": 1, **config}),  # type: ignore[arg-type]
            num_slots=128, req_to_token=self.req_to_token, device="cpu", max_batch_size=2,
            max_tokens_per_forward=16, real_kv_sources=[RealKvSource(self.kv, 1, 32, 32)],
        )  # fmt: skip

    def forward(self, count: int) -> list[Violation]:
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        prefix = self.length
        ids, pos, locs = [], [], []
        for _ in range(count):
            p = self.length
            slot = p + 1
            self.req_to_token[1, p] = slot
            ids.append(500 + p)
            pos.append(p)
            locs.append(slot)
            self.length += 1
        batch = BatchView(
            kind=ForwardKind.EXTEND if count > 1 else ForwardKind.DECODE, input_ids=t(ids), positions=t(pos),
            out_cache_loc=t(locs), req_pool_indices=t([1]), prefix_lens=t([prefix]), extend_lens=t([count]),
        )  # fmt: skip
        self.mgr.before_forward(batch)
        for token, p, slot in zip(ids, pos, locs, strict=True):
            self.kv[slot] = (token * 7 + p) % 251
        self.mgr.after_forward(batch)
        return self.mgr.step()
