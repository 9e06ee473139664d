"""A real sglang 0.5.12 ModelRunner on CPU, driven like the scheduler drives it (test helper, no kvcanary logic).

``build_runner`` builds a real ``ModelRunner`` (dummy-weight tiny Llama, torch_native attention) and a real
``RadixCache`` through ``Scheduler.init_cache_with_memory_pool`` on a bare Scheduler (as measured in
../shared/notes/sglang-cpu.md). ``MiniScheduler`` mirrors the scheduler's batch life cycle with sglang's own
objects: ``Req.init_next_round_input`` (prefix match through the RadixCache), chunked prefill as PrefillAdder
does it, ``ScheduleBatch.prepare_for_extend / prepare_for_decode / filter_batch / merge_batch``,
``ForwardBatch.init_new``, ``ModelRunner.forward / sample``, ``cache_unfinished_req`` and ``release_kv_cache``.
"""

from __future__ import annotations

import json
import socket
import types
from pathlib import Path

import torch

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def server_args(model_dir: Path, page_size: int = 1, **overrides):
    from sglang.srt.server_args import ServerArgs

    kwargs = dict(
        model_path=str(model_dir), device="cpu", load_format="dummy", skip_tokenizer_init=True,
        attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
        disable_piecewise_cuda_graph=True, max_total_tokens=1024, dtype="bfloat16", random_seed=0,
        page_size=page_size, max_running_requests=16,
    )
    kwargs.update(overrides)
    return ServerArgs(**kwargs)


def write_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def _torch_paged_allocator_class():
    """PagedTokenToKVPoolAllocator whose alloc_extend / alloc_decode are torch-only (the real ones launch Triton
    kernels, which cannot run without a GPU). Same page semantics."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, alloc_extend_naive
    from sglang.srt.utils import get_num_new_pages

    class TorchPagedAllocator(PagedTokenToKVPoolAllocator):
        def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens,
                         num_new_pages=None):
            ps = self.page_size
            if num_new_pages is None:
                num_new_pages = int(((seq_lens_cpu + ps - 1) // ps - (prefix_lens_cpu + ps - 1) // ps).sum())
            if self.need_sort and num_new_pages > len(self.free_pages):
                self.merge_and_sort_free()
            if num_new_pages > len(self.free_pages):
                return None
            out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
            alloc_extend_naive(prefix_lens, seq_lens, last_loc, self.free_pages, out, ps, self.device)
            self.free_pages = self.free_pages[num_new_pages:]
            return out

        def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
            num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True)
            if num_new_pages > len(self.free_pages):
                self.merge_and_sort_free()
            if num_new_pages > len(self.free_pages):
                return None
            need = (seq_lens % self.page_size == 1).to(torch.int64)
            start = torch.cumsum(need, 0) - need
            if num_new_pages == 0:
                out = last_loc + 1
            else:
                out = (last_loc + 1) * (1 - need) + self.free_pages[start] * self.page_size * need
            self.free_pages = self.free_pages[num_new_pages:]
            return out.to(torch.int64)

    return TorchPagedAllocator


def ensure_entry_point(tmp_path, monkeypatch) -> None:
    """kvcanary's entry point as pip would install it; synthesised (dist-info on sys.path) for a source checkout."""
    import importlib
    import importlib.metadata

    if any(ep.name == "kvcanary" for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")):
        return
    dist = tmp_path / "kvcanary_src-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcanary-src\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nkvcanary = kvcanary.sglang:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def activate_kvcanary(tmp_path, monkeypatch, env: dict[str, str]) -> dict:
    """kvcanary loaded through its entry point the way sglang loads plugins, with ``env`` (KVCANARY_* and
    SGLANG_PLUGINS) and nothing else of the caller's KVCANARY_* environment; returns the hook targets' state to
    restore at teardown (``hooks_state.restore``)."""
    import hooks_state
    import sglang.srt.plugins as plugins

    hooks_state.clear_kvcanary_env(monkeypatch)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ensure_entry_point(tmp_path, monkeypatch)
    state = hooks_state.snapshot(hooks_state.all_targets())
    hooks_state.restore(state)
    plugins.load_plugins()  # discovers kvcanary through the entry point, registers and applies its hooks
    return state


def free_port() -> int:
    """A TCP port nobody listens on now (for torch.distributed's rendezvous; tests may run side by side)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_runner(sa, nccl_port: int | None = None):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(sa)
    mr = ModelRunner(
        model_config=ModelConfig.from_server_args(sa), mem_fraction_static=0.05, gpu_id=0, tp_rank=0, tp_size=1,
        moe_ep_rank=0, moe_ep_size=1, pp_rank=0, pp_size=1,
        nccl_port=nccl_port if nccl_port is not None else free_port(), server_args=sa,
    )
    if sa.page_size > 1:
        mr.token_to_kv_pool_allocator.__class__ = _torch_paged_allocator_class()
    return mr


def bare_scheduler(mr, sa):
    """A real sglang 0.5.12 Scheduler object without its ``__init__`` (no processes, no sockets), holding what
    ``init_cache_with_memory_pool`` reads over ``mr``'s pools (a hybrid SWA runner's window and per-layer sizes too),
    its cache built by that real (hooked) method: a RadixCache, a HiRadixCache when ``sa.enable_hierarchical_cache``,
    an SWARadixCache for a hybrid SWA model."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    s = object.__new__(Scheduler)
    s.server_args = sa
    s.model_config = mr.model_config
    s.page_size = sa.page_size
    s.spec_algorithm = SpeculativeAlgorithm.NONE
    swa = bool(getattr(mr, "is_hybrid_swa", False))
    s.tp_worker = types.SimpleNamespace(
        is_hybrid_swa=swa, model_runner=mr, sliding_window_size=getattr(mr, "sliding_window_size", None),
        get_tokens_per_layer_info=lambda: (getattr(mr, "full_max_total_num_tokens", None),
                                           getattr(mr, "swa_max_total_num_tokens", None)),
        get_memory_pool=lambda: (mr.req_to_token_pool, mr.token_to_kv_pool_allocator),
        register_hicache_layer_transfer_counter=lambda counter: None,  # (the pool holds it too)
    )
    s.tp_cpu_group = s.attn_tp_cpu_group = s.attn_cp_cpu_group = None
    s.enable_metrics = s.enable_kv_cache_events = s.enable_hisparse = False
    s.enable_hierarchical_cache = bool(getattr(sa, "enable_hierarchical_cache", False))
    s.pp_rank, s.pp_size = 0, 1
    s.init_cache_with_memory_pool()
    return s


def build_tree_cache(mr, sa):
    """The prefix cache sglang's Scheduler builds over the runner's pools (:func:`bare_scheduler`)."""
    return bare_scheduler(mr, sa).tree_cache



def admit_prefills(tree, chunked_req, waiting: list, chunk: int, *, max_reqs: int) -> tuple[list, object]:
    """sglang 0.5.12's prefill admission, as the CPU mirrors of its scheduler run it: the chunked request's next chunk
    first (its cached part stashed), then requests from ``waiting`` (popped, prefix matched in ``tree`` and locked)
    while the ``chunk``-token budget lasts, the last one chunked when it does not fit. Returns the requests to
    prefill and the new chunked request (its ``is_chunked`` counted), or None."""
    from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

    budget, can_run, new_chunked = chunk, [], None
    if chunked_req is not None:
        req = chunked_req
        maybe_cache_unfinished_req(req, tree, chunked=True)  # stash_chunked_request
        req.init_next_round_input()
        req.set_extend_input_len(min(len(req.fill_ids) - len(req.prefix_indices), budget))
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        budget -= req.extend_input_len
        can_run.append(req)
        if len(req.fill_ids) < len(req.origin_input_ids):
            new_chunked = req
    while waiting and budget > 0 and new_chunked is None and len(can_run) < max_reqs:
        req = waiting.pop(0)
        req.init_next_round_input(tree)
        tree.inc_lock_ref(req.last_node)
        extend = len(req.fill_ids) - len(req.prefix_indices)
        if extend > budget:
            req.set_extend_input_len(budget)
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + budget]
            new_chunked = req
        else:
            req.set_extend_input_len(extend)
        budget -= req.extend_input_len
        can_run.append(req)
    if new_chunked is not None:
        new_chunked.is_chunked += 1
    return can_run, new_chunked

class MiniScheduler:
    """The scheduler's prefill/decode life cycle on sglang's own objects (one forward per ``step``)."""

    def __init__(self, mr, tree_cache, chunk_size: int, mixed: bool = False) -> None:
        self.mr = mr
        self.tree = tree_cache
        self.chunk = chunk_size
        self.mixed = mixed
        self.waiting: list = []
        self.running = None
        self.chunked_req = None
        self.finished: list = []
        self.forwards: list[str] = []  # forward modes, in order
        self.cached_tokens = 0  # prefix tokens matched through the RadixCache
        self.chunked_steps = 0  # prefill forwards that ended with a request still chunked
        self.reused_rows: set[int] = set()
        self._rows_seen: set[int] = set()
        self._rid = 0

    def add(self, input_ids: list[int], max_new_tokens: int) -> None:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
        sp.normalize(None)
        req = Req(rid=str(self._rid), origin_input_text="", origin_input_ids=list(input_ids), sampling_params=sp,
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
        )

    def _forward(self, batch):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        fb = ForwardBatch.init_new(batch.get_model_worker_batch(), self.mr)
        self.forwards.append(fb.forward_mode.name)
        out = self.mr.forward(fb)
        ids = self.mr.sample(out.logits_output, fb)
        batch.output_ids = ids
        return ids.tolist()

    def _release(self, req) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, self.tree)
        self.finished.append(req)

    def _finish_step(self, req, token: int) -> None:
        req.output_ids.append(token)
        req.check_finished()

    def _prefill_batch(self):
        can_run, new_chunked = admit_prefills(self.tree, self.chunked_req, self.waiting, self.chunk, max_reqs=4)
        self.cached_tokens += sum(len(r.prefix_indices) for r in can_run if r is not self.chunked_req)
        self.chunked_req = new_chunked
        if new_chunked is not None:
            self.chunked_steps += 1
        return can_run

    def step(self) -> str:
        """Run one forward: a prefill when something waits (mixed with the running decodes when ``mixed``),
        else a decode of the running batch."""
        if self.waiting or self.chunked_req is not None:
            reqs = self._prefill_batch()
            batch = self._new_batch(reqs)
            batch.prepare_for_extend()
            for r in reqs:
                if (r.req_pool_idx in self._rows_seen and r.is_chunked == 0
                        and len(r.prefix_indices) <= len(r.origin_input_ids)):
                    self.reused_rows.add(r.req_pool_idx)
                self._rows_seen.add(r.req_pool_idx)
            decoding = []
            if self.mixed and self.running is not None and not self.running.is_empty():
                self.running.prepare_for_decode()
                batch.mix_with_running(self.running)
                decoding = list(self.running.reqs)
                self.running = None
            ids = self._forward(batch)
            for req, tok in zip(batch.reqs, ids, strict=True):  # one sampled token per request
                if req.is_chunked > 0:
                    req.is_chunked -= 1
                    continue
                self._finish_step(req, tok)
                if req.finished():
                    self._release(req)
                elif req not in decoding:
                    self.tree.cache_unfinished_req(req)
            batch.filter_batch(chunked_req_to_exclude=[self.chunked_req] if self.chunked_req else None)
            if not batch.is_empty():
                if self.running is None or self.running.is_empty():
                    self.running = batch
                else:
                    self.running.merge_batch(batch)
            return self.forwards[-1]
        batch = self.running
        batch.prepare_for_decode()
        ids = self._forward(batch)
        for req, tok in zip(batch.reqs, ids, strict=True):
            self._finish_step(req, tok)
            if req.finished():
                self._release(req)
        batch.filter_batch()
        return self.forwards[-1]


def abort_running(sched: MiniScheduler) -> None:
    """Abort every running/chunked request without caching it (after a forward whose results were lost)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    reqs = list(sched.running.reqs) if sched.running is not None else []
    if sched.chunked_req is not None and sched.chunked_req not in reqs:
        reqs.append(sched.chunked_req)
    for req in reqs:
        if req.req_pool_idx is not None:
            release_kv_cache(req, sched.tree, is_insert=False)
    sched.running = None
    sched.chunked_req = None


def destroy_distributed() -> None:
    """Tear down the process groups a ModelRunner set up, so another runner can be built in this process."""
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()
