"""sglang 0.5.12's HiCache on CPU (test helper, no kvcanary logic): a real HiRadixCache, HiCacheController and
MHATokenToKVPoolHost over a real CPU ModelRunner (``sgl_engine.build_tree_cache`` with
``enable_hierarchical_cache``), and a MiniScheduler that loads host-resident prefixes back the way sglang's
PrefillAdder and Scheduler do (``init_load_back``, ``ready_to_load_host_cache``, ``check_hicache_events``).

Two things of sglang's cannot run without a GPU and are replaced here, each by torch code with the same effect:
the host buffer's allocation (``alloc_with_host_register`` calls ``cudaHostRegister``) and sgl_kernel's
``transfer_kv_direct`` (the ``direct`` io backend's copy: ``dst[dst_indices] = src[src_indices]`` per layer).
Everything else (allocation of host slots, write policies, eviction to host, load-back, acks) is sglang's own.
"""

from __future__ import annotations

import torch
from sgl_engine import MiniScheduler


def patch_host_memory(monkeypatch) -> None:
    import sglang.srt.mem_cache.memory_pool_host as mph

    def alloc_plain(dims, dtype, device, pin_memory, allocator):  # (no cudaHostRegister on a CPU-only torch)
        return torch.zeros(dims, dtype=dtype, device=device)

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
        for src, dst in zip(src_layers, dst_layers, strict=True):
            dst[dst_indices] = src[src_indices]

    monkeypatch.setitem(mph.ALLOC_MEMORY_FUNCS, "cpu", alloc_plain)
    monkeypatch.setattr(mph, "transfer_kv_direct", transfer_kv_direct)


class HiMiniScheduler(MiniScheduler):
    """MiniScheduler plus HiCache's part of scheduling: a new request whose prefix lives on the host gets it loaded
    back (PrefillAdder.add_one_req's ``init_load_back``), the loads start before the batch's forward
    (``ready_to_load_host_cache``, the forward's consumer index) and acks are checked every step."""

    def __init__(self, mr, tree_cache, chunk_size: int) -> None:
        super().__init__(mr, tree_cache, chunk_size)
        self.loaded_tokens = 0  # tokens load_back brought back from the host
        self.load_backs = 0

    def _prefill_batch(self):
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        tree = self.tree
        waiting = self.waiting
        loaded: list = []
        for req in list(waiting[:4]):  # the requests _prefill_batch may take: match and load back first
            req.init_next_round_input(tree)
            if req.host_hit_length > 0:
                new_indices, req.last_node = tree.init_load_back(InitLoadBackParams(
                    best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
                if new_indices.numel():
                    self.load_backs += 1
                    self.loaded_tokens += int(new_indices.numel())
                loaded.append(req)
        # (super() matches again: a loaded-back prefix is on the device now, so it matches as a device hit)
        return super()._prefill_batch()

    def step(self) -> str:
        self.tree.check_hicache_events()
        return super().step()

    def _forward(self, batch):
        batch.hicache_consumer_index = self.tree.ready_to_load_host_cache()
        self.mr.token_to_kv_pool.layer_transfer_counter.set_consumer(batch.hicache_consumer_index)
        return super()._forward(batch)
