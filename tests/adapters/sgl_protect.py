"""sglang 0.5.12's overlap scheduler loop on a real (bare) ``Scheduler`` object, for protect mode (test helper, no
kvcanary logic).

``build_scheduler`` makes a ``Scheduler`` through ``object.__new__`` with what ``init_cache_with_memory_pool`` needs,
runs that (hooked: kvcanary's protect attaches to it) and gives it the attributes protect reads and changes:
``running_batch``, ``last_batch``, ``cur_batch``, ``chunked_req``, ``waiting_queue``, ``spec_algorithm``,
``server_args`` and ``_add_request_to_queue`` (the real one needs the whole scheduler; this one appends to the
waiting queue, as the real one does with no priority, queue limit or disaggregation).

``OverlapLoop.iteration`` is ``Scheduler.event_loop_overlap``'s body on sglang's own objects: the protect BEFORE hook of
``get_next_batch_to_run``; the next batch (the last extend batch filtered and merged into the running batch, then a
prefill of waiting requests as ``PrefillAdder`` takes them, chunked past ``chunk``, else a decode of the running batch:
``prepare_for_extend`` / ``prepare_for_decode``); its forward (``ForwardBatch.init_new`` hooked,
``ModelRunner.forward`` hooked, ``sample``); then the previous batch's results (the protect BEFORE hook of
``process_batch_result``, then ``process_batch_result_prefill`` / ``_decode``'s rules: a finished or retracted request
is skipped, the token appended, ``check_finished``, ``release_kv_cache`` / ``cache_unfinished_req``, and
``stream_output``'s: a streaming request gets every new token, any other only its whole output when it finishes).
"""

from __future__ import annotations

from collections import deque

from sgl_engine import admit_prefills, bare_scheduler


def build_scheduler(mr, sa):
    s = bare_scheduler(mr, sa)
    s.waiting_queue = []
    s.running_batch = None
    s.last_batch = s.cur_batch = s.chunked_req = None
    s._add_request_to_queue = lambda req, is_retracted=False: s.waiting_queue.append(req)
    s.result_queue = deque()  # (batch copy, sampled ids) not processed yet, as in event_loop_overlap
    return s


class OverlapLoop:
    """The overlap event loop over ``sched`` (module docstring)."""

    def __init__(self, sched, mr, chunk: int = 4096, max_prefill_reqs: int = 8) -> None:
        from kvcanary.sglang import protect, v0_5_12

        self.s = sched
        self.mr = mr
        self.chunk = chunk
        self.max_prefill_reqs = max_prefill_reqs
        self.hooks = protect.hooks_for(v0_5_12)
        self.protect = protect.state_of(sched)
        self.finished: list = []
        self.sent: dict[str, list[int]] = {}  # rid -> tokens stream_output sent
        self.forwards = 0
        self._rid = 0

    def add(self, prompt: list[int], max_new_tokens: int, *, stream: bool = False, rid: str | None = None):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
        sp.normalize(None)
        req = Req(rid=rid or f"r{self._rid}", origin_input_text="", origin_input_ids=list(prompt), sampling_params=sp,
                  vocab_size=self.mr.model_config.vocab_size, stream=stream)
        req.logprob_start_len = -1
        self._rid += 1
        self.s.waiting_queue.append(req)
        return req

    @property
    def idle(self) -> bool:
        s = self.s
        return (not s.waiting_queue and s.chunked_req is None and not s.result_queue
                and (s.running_batch is None or s.running_batch.is_empty())
                and (s.last_batch is None or s.last_batch.is_empty())
                and (self.protect is None or not self.protect.requeue))

    def run_until_idle(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if self.idle:
                return
            self.iteration()
        raise AssertionError("the loop did not drain")

    # -------------------------------------------------------------------------------------------- the loop
    def iteration(self) -> None:
        s = self.s
        self.hooks.protect_before_schedule(s)  # (the BEFORE hook of Scheduler.get_next_batch_to_run)
        batch = self._next_batch()
        s.cur_batch = batch
        if batch is not None:
            ids = self._forward(batch)
            self.s.result_queue.append((batch.copy(), ids))
        if s.last_batch is not None:  # the previous batch's results, after this batch was launched
            self._process(*self.s.result_queue.popleft())
        s.last_batch = batch

    def _new_batch(self, reqs):
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return ScheduleBatch.init_new(
            reqs=reqs, req_to_token_pool=self.mr.req_to_token_pool,
            token_to_kv_pool_allocator=self.mr.token_to_kv_pool_allocator, tree_cache=self.s.tree_cache,
            model_config=self.mr.model_config, enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE,
        )

    def _next_batch(self):
        s = self.s
        last = s.last_batch
        if last is not None and last.forward_mode.is_extend():
            exclude = [r for r in (s.chunked_req,) if r is not None]
            last.filter_batch(chunked_req_to_exclude=exclude)
            if not last.is_empty():
                if s.running_batch is None or s.running_batch.is_empty():
                    s.running_batch = last
                else:
                    s.running_batch.merge_batch(last)
        can_run, s.chunked_req = admit_prefills(s.tree_cache, s.chunked_req, s.waiting_queue, self.chunk,
                                                max_reqs=self.max_prefill_reqs)
        if can_run:
            batch = self._new_batch(can_run)
            batch.prepare_for_extend()
            return batch
        running = s.running_batch
        if running is None or running.is_empty():
            return None
        running.filter_batch()
        if running.is_empty():
            return None
        running.prepare_for_decode()
        return running

    def _forward(self, batch) -> list[int]:
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        fb = ForwardBatch.init_new(batch.get_model_worker_batch(), self.mr)
        out = self.mr.forward(fb)
        ids = self.mr.sample(out.logits_output, fb)
        batch.output_ids = ids
        self.forwards += 1
        return ids.tolist()

    def _process(self, batch, ids: list[int]) -> None:
        from sglang.srt.mem_cache.common import maybe_cache_unfinished_req, release_kv_cache

        self.hooks.protect_before_results(self.s, batch, ids)  # (the BEFORE hook of process_batch_result)
        extend = batch.forward_mode.is_extend()
        for req, tok in zip(batch.reqs, ids, strict=True):
            if req.finished() or req.is_retracted:
                continue
            if extend and req.is_chunked > 0:
                req.is_chunked -= 1
                continue
            req.output_ids.append(tok)
            req.check_finished()
            if req.finished():
                release_kv_cache(req, self.s.tree_cache)
                self.finished.append(req)
            elif extend:
                maybe_cache_unfinished_req(req, self.s.tree_cache)
        for req in batch.reqs:  # stream_output
            if req.is_retracted and not req.finished():
                continue
            if req.finished() or req.stream:
                if req.finished() and req.finished_output:
                    continue
                if req.finished():
                    req.finished_output = True
                self.sent.setdefault(req.rid, []).extend(req.output_ids[req.send_token_offset:])
                req.send_token_offset = len(req.output_ids)
