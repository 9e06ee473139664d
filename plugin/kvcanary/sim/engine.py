"""A small deterministic paged-KV serving simulator that drives a canary manager like an engine would.

The scheduler, allocator and prefix cache are plain Python and seeded (``random.Random(seed)``), so a run is
reproducible step by step; the KV buffers, ``req_to_token`` and the batch tensors live on the simulator's device
(CPU by default, or a CUDA device), where the canary runs. ``kvcanary demo`` and ``tests/sim`` drive it.

Model of the engine (SGLang-like, deliberately small):

* **KV pool**: ``num_pages * page_size`` slots; page 0 (slot 0..page_size-1) is reserved, slot 0 being the
  padding slot. Real KV lives in two uint8 buffers (K and V) ``[num_pages, page_size * 64]``; the 64 bytes of
  slot ``s`` are a deterministic function of (token, position, hash of the request's token prefix), written by
  the "model" for every ``out_cache_loc`` slot of a forward. Identical prefixes give identical KV bytes.
* **Allocator**: a LIFO free list of pages, so freed slots are reused quickly by other requests.
* **req_to_token**: int32 ``[max_running + 1, max_ctx]``; row 0 is the padding row, rows are allocated per
  request and released when it finishes.
* **Prefix cache**: a trie of pages (key = the page's token tuple); finished requests insert their full pages
  (pages already cached are duplicates and go back to the allocator); new requests match the longest cached
  page-aligned prefix (leaving at least one prompt token to compute) and lock the matched path. Unlocked
  leaves are evicted LRU when the allocator runs short.
* **Scheduling**: one forward per step. Prefill has priority: the chunked request continues first, then waiting
  requests are admitted within a ``chunk_size`` token budget (the last one may be chunked, so long prompts take
  several EXTEND forwards with prefix > 0). Running requests decode one token per DECODE forward; with
  probability ``p_mixed`` a prefill chunk and the decodes share one MIXED forward; with ``p_idle`` a forward is
  IDLE (bs 0). Admission reserves the whole request (prompt + max_new), so decode never runs out of slots.
* Generated tokens are a function of (request id, position).

Per forward: build the ``BatchView``; ``update_expected_tokens`` with what each row appended since its last
upload (if the token check is on); ``mgr.before_forward``; the model writes KV; ``mgr.after_forward``;
``mgr.step()``.

Fault hooks: ``Simulator(hook=fn)`` calls ``fn(point, sim)`` at ``"pre_schedule"`` (before the step's
scheduling and allocation), ``"pre_forward"`` (batch built and installed in ``sim.batch``, before
``before_forward``), ``"pre_step"`` (after ``after_forward``, before ``mgr.step()``) and ``"post_step"``. A hook
may mutate the batch tensors (the model then consumes the mutated batch, as it would in an engine), the KV
buffers, ``req_to_token``, and use ``abort``, ``free_slot_early``, ``extend_life``.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcanary.batch import BatchView, ForwardKind
from kvcanary.real_kv import RealKvSource

M64 = (1 << 64) - 1
KV_BYTES = 64  # bytes per token per KV buffer


def mix(*values: int) -> int:
    """splitmix64 fold of ints (the simulator's own hash; unrelated to the canary's)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & M64)) & M64
        h ^= h >> 30
        h = (h * 0xBF58476D1CE4E5B9) & M64
        h ^= h >> 27
        h = (h * 0x94D049BB133111EB) & M64
        h ^= h >> 31
    return h


@dataclass
class SimConfig:
    seed: int = 0
    num_pages: int = 1024  # slots = num_pages * page_size
    page_size: int = 1
    max_running: int = 8
    max_ctx: int = 256
    chunk_size: int = 48
    vocab: int = 500
    prompt_len: tuple[int, int] = (2, 120)
    max_new: tuple[int, int] = (1, 40)
    p_arrival: float = 0.5
    max_waiting: int = 4
    p_mixed: float = 0.3
    p_idle: float = 0.03
    verify_tokens: bool = True
    read_bytes: tuple[int, int] = (64, 32)  # fingerprinted bytes of K, V (mode ALL)
    reserve_tokens: int = 96  # admission keeps room for this many tokens spare (extend_life of fault victims)
    evict_batch: int = 32  # pages evicted at once when the free list runs dry


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new: int
    tokens: list[int] = field(default_factory=list)  # prompt + sampled tokens (the last sampled one has no KV yet)
    hashes: list[int] = field(default_factory=list)  # hashes[p]: prefix hash of tokens[0..p]
    slots: list[int] = field(default_factory=list)  # slot of each position with KV (mirror of the req_to_token row)
    owned: list[int] = field(default_factory=list)  # pages this request allocated (not from the cache)
    path: list[Node] = field(default_factory=list)  # locked prefix-cache nodes
    row: int = 0
    kv_len: int = 0  # positions whose KV is written
    generated: int = 0
    expected_len: int = 0  # tokens[:expected_len] are uploaded to the manager's token check

    @property
    def prefilling(self) -> bool:
        return self.kv_len < len(self.prompt)

    def prefix_hash(self, pos: int) -> int:
        while len(self.hashes) <= pos:
            p = len(self.hashes)
            self.hashes.append(mix(self.hashes[-1] if p else 0, self.tokens[p], p))
        return self.hashes[pos]


@dataclass(eq=False)
class Node:
    """A prefix-cache page: ``page`` holds the tokens ``key`` at depth ``depth`` (positions depth*ps ...)."""

    key: tuple[int, ...]
    page: int
    depth: int
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock: int = 0
    last_access: int = 0
    serial: int = 0  # creation order: a deterministic LRU tie-break


class Simulator:
    """The engine: ``step()`` schedules and runs one forward through the manager (see the module docstring)."""

    def __init__(self, cfg: SimConfig, mgr_factory: Callable[..., object] | None = None,
                 hook: Callable[[str, Simulator], None] | None = None, *, device: torch.device | str = "cpu") -> None:
        self.cfg, self.hook = cfg, hook
        self.device = torch.device(device)
        self.rng = random.Random(cfg.seed)
        ps = cfg.page_size
        self.num_slots = cfg.num_pages * ps
        self.k_buf = torch.zeros((cfg.num_pages, ps * KV_BYTES), dtype=torch.uint8, device=self.device)
        self.v_buf = torch.zeros((cfg.num_pages, ps * KV_BYTES), dtype=torch.uint8, device=self.device)
        self.sources = (RealKvSource(self.k_buf, ps, KV_BYTES, cfg.read_bytes[0]),
                        RealKvSource(self.v_buf, ps, KV_BYTES, cfg.read_bytes[1]))
        self.req_to_token = torch.zeros((cfg.max_running + 1, cfg.max_ctx), dtype=torch.int32, device=self.device)
        self.free_pages = list(range(cfg.num_pages - 1, 0, -1))  # LIFO stack; page 0 reserved
        self.free_rows = list(range(cfg.max_running, 0, -1))
        self.root = Node((), -1, -1, None)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admitted (prefilling or decoding), in admission order
        self.finished_prompts: list[list[int]] = []  # for multi-turn prompts
        self.system_prompts = [[self.rng.randrange(cfg.vocab) for _ in range(self.rng.randint(8, 64))]
                               for _ in range(6)]
        self.next_rid = 1
        self.nodes_created = 0
        self.step_no = 0
        self.batch: BatchView | None = None
        self.batch_reqs: list[Request] = []  # request of each batch row
        self.stats: Counter[str] = Counter()
        self.slot_writers: dict[int, int] = {}  # slot -> last writer rid
        self.mgr = None
        if mgr_factory is not None:
            self.mgr = mgr_factory(num_slots=self.num_slots, req_to_token=self.req_to_token, device=self.device,
                                   max_batch_size=cfg.max_running,
                                   max_tokens_per_forward=cfg.chunk_size + cfg.max_running,
                                   real_kv_sources=self.sources)
            self.mgr.set_sweep_source(self.sweep_source)

    # ---------------------------------------------------------------- pool, cache
    def slot_of(self, page: int, offset: int = 0) -> int:
        return page * self.cfg.page_size + offset

    def alloc_page(self) -> int:
        if not self.free_pages and not self.evict(self.cfg.evict_batch):
            raise RuntimeError("simulator: KV pool exhausted (admission reserves too little)")
        return self.free_pages.pop()

    def free_page(self, page: int) -> None:
        assert page != 0
        self.free_pages.append(page)

    def evictable_leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and not n.children and n.lock == 0:
                out.append(n)
        return out

    def evict(self, pages: int) -> int:
        """Free up to ``pages`` pages by evicting unlocked leaves, least recently used first."""
        heap = [(n.last_access, n.serial, n) for n in self.evictable_leaves()]
        heapq.heapify(heap)
        done = 0
        while heap and done < pages:
            _, _, n = heapq.heappop(heap)
            del n.parent.children[n.key]
            self.free_page(n.page)
            self.stats["evicted_pages"] += 1
            done += 1
            p = n.parent
            if p is not self.root and not p.children and p.lock == 0:
                heapq.heappush(heap, (p.last_access, p.serial, p))
        return done

    def evictable_count(self) -> int:
        """Pages that eviction could free: unlocked nodes (a lock covers a node's whole path to the root, so
        every unlocked node can be evicted once its unlocked descendants are)."""
        n, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            n += node.lock == 0
        return n

    def match(self, tokens: list[int]) -> list[Node]:
        ps, node, path = self.cfg.page_size, self.root, []
        limit = (len(tokens) - 1) // ps  # leave at least one token to compute
        for d in range(limit):
            child = node.children.get(tuple(tokens[d * ps:(d + 1) * ps]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def insert(self, req: Request) -> None:
        """Cache the full pages of a finished request; duplicates and the partial tail go back to the allocator."""
        ps, node = self.cfg.page_size, self.root
        cached = set()
        for d in range(req.kv_len // ps):
            key = tuple(req.tokens[d * ps:(d + 1) * ps])
            page = req.slots[d * ps] // ps
            child = node.children.get(key)
            if child is None:
                self.nodes_created += 1
                child = node.children[key] = Node(key, page, d, node, serial=self.nodes_created)
            elif child.page != page:
                self.stats["duplicate_pages"] += 1  # already cached by another request: ours is freed below
            if child.page == page:
                cached.add(page)
            child.last_access = self.step_no
            node = child
        for page in req.owned:
            if page not in cached:
                self.free_page(page)

    def sweep_source(self) -> tuple[list[int], list[int], list[int]]:
        slots, prevs, positions = [], [], []
        ps = self.cfg.page_size
        stack = [(c, -1) for c in self.root.children.values()]
        while stack:
            n, prev = stack.pop()
            for o in range(ps):
                s = self.slot_of(n.page, o)
                slots.append(s)
                prevs.append(prev)
                positions.append(n.depth * ps + o)
                prev = s
            stack.extend((c, prev) for c in n.children.values())
        self.stats["sweeps"] += 1
        self.stats["sweep_entries"] += len(slots)
        return slots, prevs, positions

    # ---------------------------------------------------------------- requests
    def new_request(self) -> Request:
        cfg, rng = self.cfg, self.rng
        max_new = rng.randint(*cfg.max_new)
        r = rng.random()
        if r < 0.5:
            prompt = list(rng.choice(self.system_prompts))
        elif r < 0.75 and self.finished_prompts:
            prompt = list(rng.choice(self.finished_prompts))  # multi-turn: the whole previous conversation
        else:
            prompt = []
        prompt += [rng.randrange(cfg.vocab) for _ in range(rng.randint(*cfg.prompt_len))]
        prompt = prompt[: cfg.max_ctx - cfg.max_new[1] - 1]
        req = Request(self.next_rid, prompt, max_new, tokens=list(prompt))
        self.next_rid += 1
        return req

    def sample(self, req: Request) -> int:
        return mix(req.rid, len(req.tokens)) % self.cfg.vocab

    def reserved(self) -> int:
        """Pages running requests may still need (worst case)."""
        ps = self.cfg.page_size
        return sum(-(-(len(r.prompt) + r.max_new) // ps) - len(r.slots) // ps for r in self.running)

    def admit(self, req: Request) -> bool:
        ps = self.cfg.page_size
        path = self.match(req.prompt)
        need = -(-(len(req.prompt) + req.max_new) // ps) - len(path)
        if not self.free_rows:
            return False
        want = need + self.reserved() + -(-self.cfg.reserve_tokens // ps)
        if want > len(self.free_pages) and want > len(self.free_pages) + self.evictable_count() - len(path):
            return False
        for n in path:
            n.lock += 1
            n.last_access = self.step_no
        req.path, req.row = path, self.free_rows.pop()
        req.slots = [self.slot_of(n.page, o) for n in path for o in range(ps)]
        req.kv_len = len(req.slots)
        self.req_to_token[req.row, : req.kv_len] = torch.tensor(req.slots, dtype=torch.int32, device=self.device)
        if path:
            self.stats["cache_hits"] += 1
            self.stats["cache_hit_tokens"] += req.kv_len
        self.running.append(req)
        return True

    def release(self, req: Request, cache: bool) -> None:
        if cache:
            self.insert(req)
            self.finished_prompts.append(req.tokens[: req.kv_len])
            self.finished_prompts = self.finished_prompts[-20:]
        else:
            for page in req.owned:
                self.free_page(page)
        for n in req.path:
            n.lock -= 1
        self.running.remove(req)
        self.req_to_token[req.row].zero_()
        self.free_rows.append(req.row)
        req.row = 0

    def abort(self, req: Request) -> None:
        """Retire a request without caching it (its own slots go back to the allocator)."""
        if req in self.running:
            self.release(req, cache=False)
            self.stats["aborted"] += 1

    def free_slot_early(self, req: Request, pos: int) -> int:
        """The stale-reuse bug: give the (own, page_size 1) slot at ``pos`` back while ``req`` still maps it.

        The slot goes on top of the LIFO free list, so the next allocation hands it to someone else.
        """
        assert self.cfg.page_size == 1
        slot = req.slots[pos]
        req.owned.remove(slot)
        self.free_page(slot)
        return slot

    def extend_life(self, req: Request, extra: int) -> None:
        """Keep ``req`` decoding for at least ``extra`` more tokens from now (bounded by max_ctx), e.g. until a fault
        is detected. A request extended again does not grow past that (admission reserved only so much)."""
        req.max_new = min(max(req.max_new, req.generated + extra), self.cfg.max_ctx - len(req.prompt) - 1)

    def grow(self, req: Request, n: int) -> list[int]:
        """Allocate the slots of the next ``n`` positions of ``req`` (page-aligned allocation)."""
        ps, out = self.cfg.page_size, []
        for _ in range(n):
            pos = len(req.slots)
            if pos % ps == 0:
                page = self.alloc_page()
                req.owned.append(page)
                slot = self.slot_of(page)
            else:
                slot = req.slots[-1] + 1
            req.slots.append(slot)
            out.append(slot)
        self.req_to_token[req.row, pos - n + 1: pos + 1] = torch.tensor(out, dtype=torch.int32, device=self.device)
        return out

    # ---------------------------------------------------------------- one forward
    def schedule(self) -> tuple[ForwardKind, list[tuple[Request, int]]]:
        """Pick the forward's rows: (request, tokens to extend) in batch order."""
        cfg, rng = self.cfg, self.rng
        while len(self.waiting) < cfg.max_waiting and rng.random() < cfg.p_arrival:
            self.waiting.append(self.new_request())
        if rng.random() < cfg.p_idle:
            return ForwardKind.IDLE, []
        prefill: list[tuple[Request, int]] = []
        budget = cfg.chunk_size
        for req in [r for r in self.running if r.prefilling]:  # the chunked request continues first
            n = min(len(req.prompt) - req.kv_len, budget)
            prefill.append((req, n))
            budget -= n
        while budget > 0 and self.waiting and self.admit(self.waiting[0]):
            req = self.waiting.pop(0)
            n = min(len(req.prompt) - req.kv_len, budget)
            prefill.append((req, n))
            budget -= n
        decode = [(r, 1) for r in self.running if not r.prefilling and r not in [p for p, _ in prefill]]
        if prefill and decode and rng.random() < cfg.p_mixed:
            return ForwardKind.MIXED, prefill + decode
        if prefill:
            return ForwardKind.EXTEND, prefill
        if decode:
            return ForwardKind.DECODE, decode
        return ForwardKind.IDLE, []

    def run_model(self, batch: BatchView) -> None:
        """The 'model': KV bytes of every out_cache_loc slot from the batch's (token, position, prefix)."""
        seeds, slots, t = [], [], 0
        locs, ids, positions = batch.out_cache_loc.tolist(), batch.input_ids.tolist(), batch.positions.tolist()
        for req, n in zip(self.batch_reqs, batch.extend_lens.tolist(), strict=True):
            for i in range(t, t + n):
                slot, tok, pos = locs[i], ids[i], positions[i]
                if 0 < slot < self.num_slots:  # an out-of-range slot would crash a real model: skip it
                    prev = req.prefix_hash(pos - 1) if 0 < pos <= len(req.tokens) else 0
                    seeds.append(mix(prev, tok, pos) >> 1)
                    slots.append(slot)
                    if self.slot_writers.get(slot, req.rid) != req.rid:
                        self.stats["slot_rewrites_by_other_request"] += 1
                    self.slot_writers[slot] = req.rid
            t += n
        if not slots:
            return
        idx = torch.tensor(slots, device=self.device)
        seed = torch.tensor(seeds, dtype=torch.int64)[:, None] ^ (torch.arange(8) * 0x2545F4914F6CDD1D)
        for buf, salt in ((self.k_buf, 0), (self.v_buf, 0x5DEECE66D)):
            x = seed ^ salt
            for _ in range(2):  # int64 arithmetic wraps: a cheap deterministic scramble
                x = x ^ (x >> 29)
                x = x * 0xBF58476D1CE4E5B
                x = x ^ (x >> 32)
            values = x.view(torch.uint8).reshape(len(slots), KV_BYTES).to(self.device)
            buf.view(self.num_slots, KV_BYTES).index_copy_(0, idx, values)

    def step(self) -> BatchView:
        """Run one forward through the manager; returns its batch."""
        self.step_no += 1
        self._hook("pre_schedule")
        kind, rows = self.schedule()
        ps = self.cfg.page_size
        self.batch_reqs = [r for r, _ in rows]
        ids, pos, loc, prefix = [], [], [], []
        for req, n in rows:
            prefix.append(req.kv_len)
            loc += self.grow(req, n)
            ids += req.tokens[req.kv_len: req.kv_len + n]
            pos += range(req.kv_len, req.kv_len + n)
        i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        self.batch = batch = BatchView(kind, i64(ids), i64(pos), i64(loc), i64([r.row for r, _ in rows]),
                                       i64(prefix), i64([n for _, n in rows]))
        self.stats[f"forward_{kind.value}"] += 1
        self.stats["extend_rows_prefix_gt0"] += sum(1 for r, n in rows if r.prefilling and r.kv_len > 0)
        self.stats["chunk_continuations"] += sum(1 for r, n in rows if r.prefilling and r.kv_len > len(r.path) * ps)
        self.stats["tokens"] += len(ids)
        if self.mgr is not None and self.cfg.verify_tokens:
            # Only what each row appended since its last upload (a whole prompt for a new request), in one call.
            updates = [(req.row, req.expected_len, req.tokens[req.expected_len:]) for req, _ in rows
                       if req.expected_len != len(req.tokens)]
            if updates:
                self.mgr.update_expected_tokens(updates)
                for req, _ in rows:
                    req.expected_len = len(req.tokens)
        self._hook("pre_forward")
        if self.mgr is not None:
            self.mgr.before_forward(batch)
        self.run_model(batch)
        if self.mgr is not None:
            self.mgr.after_forward(batch)
        self._hook("pre_step")
        if self.mgr is not None:
            self.mgr.step()
        for req, n in rows:  # host bookkeeping after the forward
            req.kv_len += n
            if req.prefilling or req.row == 0:
                continue
            req.tokens.append(self.sample(req))
            req.generated += 1
            if req.generated >= req.max_new:
                self.release(req, cache=True)
                self.stats["finished"] += 1
        self._hook("post_step")
        return batch

    def _hook(self, point: str) -> None:
        if self.hook is not None:
            self.hook(point, self)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()


def build_sim(sim_cfg: SimConfig, *, mode: str = "raise", sweep_interval: int = 10, real_kv: str = "partial",
              hook: Callable[[str, Simulator], None] | None = None, drain_every: int = 1,
              device: torch.device | str = "cpu") -> Simulator:
    """A simulator driving a fresh ``CanaryManager`` on ``device`` (init finished: the chain-position assert is on).

    ``drain_every=1`` (the default here, not the runtime's) reports each violation after the forward that found
    it, so a fault driver can attribute it to that forward.
    """
    from kvcanary.config import Config, Mode
    from kvcanary.layout import RealKvHashMode
    from kvcanary.manager import CanaryManager

    config = Config(mode=Mode(mode), real_kv=RealKvHashMode[real_kv.upper()], sweep_interval=sweep_interval,
                    stats_every=0, verify_tokens=sim_cfg.verify_tokens, ring_capacity=4096, drain_every=drain_every)
    sim = Simulator(sim_cfg, mgr_factory=lambda **kw: CanaryManager(config, **kw), hook=hook, device=device)
    sim.mgr.mark_init_finished()
    return sim
