"""A real sglang 0.5.23 ModelRunner on CPU, driven the way 0.5.23's scheduler drives it (test helper, no kvcanary).

0.5.23 differs from 0.5.12 in how a runner comes up: the process publishes its ServerArgs (``runtime_context.publish``
with a rank bundle) and builds the process groups (``distributed.bootstrap``) before the runner; the runner's
``__init__`` only loads the model; the scheduler then calls ``alloc_memory_pool``, ``init_attention_backends`` and
``init_cuda_graphs``, and builds the prefix cache with ``mem_cache.kv_cache_builder.build_kv_cache`` (the default
cache is ``UnifiedRadixCache``). ``MiniScheduler`` mirrors the scheduler's batch life cycle with sglang's own objects:
``Req.init_next_round_input`` (prefix match), ``tree_cache.lock``, ``extend_end`` (chunked prefill as PrefillAdder
sets it), ``checkpoint_kv_cache`` (stash a chunk / publish an unfinished prefill), ``release_kv_cache``,
``ScheduleBatch.prepare_for_extend / prepare_for_decode / filter_batch / merge_batch``, ``ForwardBatch.init_new``,
``ModelRunner.forward / sample``.
"""

from __future__ import annotations

import types
from array import array
from pathlib import Path

import torch
from sgl_engine import TINY_LLAMA, free_port, write_model_dir  # noqa: F401  (one tiny model for both versions)


def server_args(model_dir: Path, page_size: int = 1, **overrides):
    from sglang.srt.server_args import ServerArgs

    kwargs = dict(
        model_path=str(model_dir), device="cpu", load_format="dummy", skip_tokenizer_init=True,
        attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
        max_total_tokens=1024, dtype="bfloat16", random_seed=0, page_size=page_size, max_running_requests=16,
    )
    kwargs.update(overrides)
    return ServerArgs(**kwargs)


def build_runner(sa, nccl_port: int | None = None):
    """publish → process groups → ModelRunner → KV pools → attention backends → graphs (the scheduler's order)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import bootstrap
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.runtime_context import SpawnRanks, publish

    port = nccl_port if nccl_port is not None else free_port()
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    mc = ModelConfig.from_server_args(sa)
    bootstrap.init_parallel_runtime(server_args=sa, device="cpu", dist_port=port)
    bootstrap.init_layer_runtime(model_config=mc)
    mr = ModelRunner(model_config=mc, mem_fraction_static=0.05, gpu_id=0, nccl_port=port, server_args=sa)
    mr.alloc_memory_pool()
    if sa.page_size > 1:
        from sgl_engine import _torch_paged_allocator_class

        mr.token_to_kv_pool_allocator.__class__ = _torch_paged_allocator_class()
    mr.init_attention_backends()
    mr.init_cuda_graphs()
    return mr


def build_tree_cache(mr, sa):
    """The prefix cache 0.5.23's Scheduler.__init__ builds, through the real (hooked) ``build_kv_cache``."""
    from sglang.srt.mem_cache import kv_cache_builder
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    tp_worker = types.SimpleNamespace(
        model_runner=mr, is_hybrid_swa=mr.is_hybrid_swa, sliding_window_size=getattr(mr, "sliding_window_size", None),
        get_memory_pool=lambda: (mr.req_to_token_pool, mr.token_to_kv_pool_allocator),
        register_hicache_layer_transfer_counter=lambda counter: None,
    )
    result = kv_cache_builder.build_kv_cache(
        server_args=sa, model_config=mr.model_config, tp_worker=tp_worker, page_size=sa.page_size,
        spec_algorithm=SpeculativeAlgorithm.NONE, enable_metrics=False, enable_kv_cache_events=False,
        enable_hierarchical_cache=False,
    )
    return result.tree_cache


class MiniScheduler:
    """The scheduler's prefill/decode life cycle on sglang 0.5.23's own objects (one forward per ``step``)."""

    def __init__(self, mr, tree_cache, chunk_size: int) -> None:
        self.mr = mr
        self.tree = tree_cache
        self.chunk = chunk_size
        self.waiting: list = []
        self.running = None
        self.chunked_req = None
        self.finished: list = []
        self.forwards: list[str] = []
        self.cached_tokens = 0  # prefix tokens matched through the prefix cache
        self.chunked_steps = 0
        self.reused_rows: set[int] = set()
        self._rows_seen: set[int] = set()
        self._rid = 0

    def add(self, input_ids: list[int], max_new_tokens: int) -> None:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
        sp.normalize(None)
        req = Req(rid=str(self._rid), origin_input_text="", origin_input_ids=array("q", input_ids), sampling_params=sp,
                  vocab_size=self.mr.model_config.vocab_size)
        req.logprob_start_len = -1
        self._rid += 1
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.waiting and self.chunked_req is None and (self.running is None or self.running.is_empty())

    def _new_batch(self, reqs):
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return ScheduleBatch.init_new(
            reqs=reqs, req_to_token_pool=self.mr.req_to_token_pool,
            token_to_kv_pool_allocator=self.mr.token_to_kv_pool_allocator, tree_cache=self.tree,
            model_config=self.mr.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE,
            chunked_req=self.chunked_req,
        )

    def _forward(self, batch):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device)  # as benchmark/one_batch.py does
            batch.prefill_input_ids_cpu = None
        fb = ForwardBatch.init_new(batch, self.mr, return_hidden_states_before_norm=False)
        self.forwards.append(fb.forward_mode.name)
        out = self.mr.forward(fb)
        return self.mr.sample(out.logits_output, fb).tolist()

    def _release(self, req) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree, checkpoint=True)
        self.finished.append(req)

    def _prefill_reqs(self) -> list:
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        budget = self.chunk
        can_run = []
        new_chunked = None
        if self.chunked_req is not None:  # Scheduler.stash_chunked_request + PrefillAdder.add_chunked_req
            req = self.chunked_req
            checkpoint_kv_cache(req, self.tree)
            n = min(len(req.full_untruncated_fill_ids) - req.prefix_len, budget)
            req.extend_end = req.prefix_len + n
            budget -= n
            can_run.append(req)
            if req.extend_end < len(req.full_untruncated_fill_ids):
                new_chunked = req
        while self.waiting and budget > 0 and new_chunked is None and len(can_run) < 4:
            req = self.waiting.pop(0)
            req.init_next_round_input(self.tree)
            self.cached_tokens += req.prefix_len
            extend = len(req.full_untruncated_fill_ids) - req.prefix_len
            if extend > budget:
                req.extend_end = req.prefix_len + budget
                new_chunked = req
            else:
                req.extend_end = len(req.full_untruncated_fill_ids)
            req.lock = self.tree.lock(req.last_node)
            budget -= req.extend_len
            can_run.append(req)
        self.chunked_req = new_chunked
        if new_chunked is not None:
            self.chunked_steps += 1
        return can_run

    def step(self) -> str:
        """One forward: a prefill when something waits (or a chunk is pending), else a decode of the running batch."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache

        if self.waiting or self.chunked_req is not None:
            reqs = self._prefill_reqs()
            batch = self._new_batch(reqs)
            batch.prepare_for_extend()
            for r in reqs:
                row = int(r.kv.req_pool_idx)
                if row in self._rows_seen and r is not self.chunked_req and r.prefix_len <= len(r.origin_input_ids):
                    self.reused_rows.add(row)
                self._rows_seen.add(row)
            ids = self._forward(batch)
            for req, tok in zip(batch.reqs, ids, strict=True):
                if req is self.chunked_req:
                    continue  # a middle chunk: its sampled token is dropped
                req.output_ids.append(tok)
                req.update_finish_state()
                if req.finished():
                    self._release(req)
                else:
                    checkpoint_kv_cache(req, self.tree)
            batch.filter_batch(reqs_to_exclude=[self.chunked_req] if self.chunked_req else None)
            if not batch.is_empty():
                if self.running is None or self.running.is_empty():
                    self.running = batch
                else:
                    self.running.merge_batch(batch)
            return self.forwards[-1]
        batch = self.running
        batch.input_ids = torch.tensor([r.output_ids[-1] for r in batch.reqs], dtype=torch.int64, device=batch.device)
        batch.prepare_for_decode()
        ids = self._forward(batch)
        for req, tok in zip(batch.reqs, ids, strict=True):
            req.output_ids.append(tok)
            req.update_finish_state()
            if req.finished():
                self._release(req)
        batch.filter_batch()
        return self.forwards[-1]


def abort_running(sched: MiniScheduler) -> None:
    """Drop every running/chunked request without publishing it (after a forward whose results were lost)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    reqs = list(sched.running.reqs) if sched.running is not None else []
    if sched.chunked_req is not None and sched.chunked_req not in reqs:
        reqs.append(sched.chunked_req)
    for req in reqs:
        if req.kv.holds_kv:
            release_kv_cache(req, sched.tree, checkpoint=False)
    sched.running = None
    sched.chunked_req = None


def destroy_distributed() -> None:
    """Tear down the process groups and the parallel-runtime guard, so another runner can come up in this process."""
    import torch.distributed as dist
    from sglang.srt.distributed import bootstrap, parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()
    bootstrap.reset_parallel_initialised()
