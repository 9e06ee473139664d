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
* Generated tokens are a function of (request id, position); with ``SimConfig.kv_sampling`` also of a digest of
  the K/V bytes the request reads through its ``req_to_token`` row (every position with KV, as the table maps them:
  a redirected or out-of-range entry reads another slot, or zeros), so KV that is not what the model wrote changes
  what the request generates from then on. The clean KV of a position is a function of the tokens up to it, so
  :meth:`Simulator.clean_tokens` computes, without running anything, the tokens a request generates over clean KV.
* **Retraction** (:meth:`Simulator.retract`, protect mode's recompute): a running request is released without
  caching its KV and requeued (at the head of the waiting queue) as a new request with the same id, the tokens it
  keeps as its prompt and the rest of its output to generate; :meth:`Simulator.discard` drops prefix-cache nodes
  with their subtrees (device pages freed, host copies dropped).
* **Host KV tier** (``host_pages > 0``; HiCache-like): host-memory K/V buffers ``[host_pages, page_size * 64]`` of
  their own (same per-token layout; host page 0 reserved like device page 0) and a LIFO free list of host pages.
  Eviction backs a cached page up before freeing it (K/V copied device → host, ``mgr.backup_to_host``; one batched
  copy per eviction round) and keeps its node in the tree, on the host only; a page already backed up is just
  freed. A request whose prefix match reaches host-only nodes gets new device pages for them and a load-back
  (``mgr.load_from_host`` first, so the records are there before the forward that verifies them, then the K/V
  copy host → device). Host pages run short: host-only leaves are dropped LRU first, then host copies of pages
  that are on the device again; a page that finds no host page is dropped as before. A finished request whose
  page is cached on the host only hands its page to that node.
* Each batch's rows are assigned to their requests (``mgr.assign_requests``), as the SGLang adapter does, so
  violations name the writing request and a loaded-back slot's say ``via=host_tier``.

Per forward: build the ``BatchView``; ``update_expected_tokens`` with what each row appended since its last
upload (if the token check is on); ``mgr.before_forward``; the model writes KV; ``mgr.after_forward``;
``mgr.step()``.

Fault hooks: ``Simulator(hook=fn)`` calls ``fn(point, sim)`` at ``"pre_schedule"`` (before the step's
scheduling and allocation), ``"pre_forward"`` (batch built and installed in ``sim.batch``, before
``before_forward``), ``"pre_step"`` (after ``after_forward``, before ``mgr.step()``), ``"pre_results"`` (after
``mgr.step()``, before the forward's tokens are appended to its requests) and ``"post_step"``; with a host tier
also ``"pre_load"`` (a load-back's records followed, its K/V not copied yet: ``sim.load`` describes it, and its
``kv_device_slots`` may be changed) and ``"post_load"`` (the K/V copied). A hook may mutate the batch
tensors (the model then consumes the mutated batch, as it would in an engine), the KV buffers (device and host),
``req_to_token``, and use ``abort``, ``free_slot_early``, ``extend_life``, ``pin``/``unpin``, ``repair_kv``, and
``retract`` / ``discard`` (protect mode: :mod:`kvcanary.sim.protect`).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource

M64 = (1 << 64) - 1
KV_BYTES = 64  # bytes per token per KV buffer
NO_PAGE = -1  # Node.page of a node whose K/V is on the host only


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
    token_mail: bool = False  # decode batches' token appends through the check launch's mailbox (CanaryManager's)
    read_bytes: tuple[int, int] = (64, 32)  # fingerprinted bytes of K, V (mode ALL)
    reserve_tokens: int = 96  # admission keeps room for this many tokens spare (extend_life of fault victims)
    evict_batch: int = 32  # pages evicted at once when the free list runs dry
    host_evict_batch: int = 128  # host pages freed at once when the host tier is full
    host_pages: int = 0  # host KV tier pages (0: no host tier); sglang's HiCache defaults to twice the device pool
    kv_sampling: bool = False  # sampled tokens also depend on the K/V the request reads (module docstring)


@dataclass(eq=False)
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
    origin_len: int = -1  # length of the prompt the client sent (a retracted request's prompt also holds outputs)
    recomputes: int = 0  # times retracted and requeued
    fate: str = ""  # "finished", "aborted" or "retracted" once it left the running list

    def __post_init__(self) -> None:
        if self.origin_len < 0:
            self.origin_len = len(self.prompt)

    @property
    def output(self) -> list[int]:
        """The tokens generated for the client's prompt (a retracted request's kept outputs included)."""
        return self.tokens[self.origin_len:]

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
    hashes: tuple[int, ...] = ()  # prefix hash of each position of the page: its K/V (Simulator.kv_rows)
    host_page: int | None = None  # host-tier page holding a copy of the K/V (a backup), if any

    @property
    def on_device(self) -> bool:
        return self.page != NO_PAGE


@dataclass
class LoadBack:
    """One load-back in progress (``Simulator.load`` between the ``pre_load`` and ``post_load`` hooks)."""

    request: Request  # the request whose prefix match reached the host-only nodes
    nodes: list[Node]  # the nodes loaded, in path order
    host_slots: list[int]
    device_slots: list[int]  # the new device slots, as the records (mgr.load_from_host) have them
    kv_device_slots: torch.Tensor  # where the K/V copy writes host_slots[i] (a fault may misdirect it)


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
        self.slot_writers: dict[int, int] = {}  # slot -> last writer rid (a load-back: a negative serial)
        # The host tier lives in host memory whatever the simulator's device (the engine's pinned host pool).
        self.host_tier = cfg.host_pages > 0
        self.num_host_slots = cfg.host_pages * ps
        self.host_k = torch.zeros((max(cfg.host_pages, 1), ps * KV_BYTES), dtype=torch.uint8)
        self.host_v = torch.zeros_like(self.host_k)
        self.host_sources = (RealKvSource(self.host_k, ps, KV_BYTES, cfg.read_bytes[0]),
                             RealKvSource(self.host_v, ps, KV_BYTES, cfg.read_bytes[1]))
        # host page 0 is reserved like device page 0: the records' tier sends a bad device-side index to row 0
        self.free_host_pages = list(range(cfg.host_pages - 1, 0, -1))
        self._pending_backups: dict[int, int] = {}  # host page -> device page, copied at the end of an eviction
        # The cached nodes by where their K/V is (insertion-ordered dicts: a run is reproducible): eviction scans
        # these instead of walking the whole tree, which the host tier makes three times larger.
        self.device_nodes: dict[Node, None] = {}
        self.host_nodes: dict[Node, None] = {}  # on the host only
        self.load: LoadBack | None = None
        # kv_sampling: the digest's weights, one per (position, K/V, byte), below 2**31 so a digest (at most
        # max_ctx * 128 products of a byte and a weight) never overflows int64.
        gen = torch.Generator().manual_seed(cfg.seed ^ 0x5EED)
        self.digest_weights = torch.randint(1, 1 << 31, (cfg.max_ctx, 2, KV_BYTES), dtype=torch.int64, generator=gen)
        self._device_weights = self.digest_weights.to(self.device) if cfg.kv_sampling else None
        self.finished: list[Request] = []  # (kv_sampling) requests that finished normally, in finishing order
        self.mgr = None
        if mgr_factory is not None:
            self.mgr = mgr_factory(num_slots=self.num_slots, req_to_token=self.req_to_token, device=self.device,
                                   max_batch_size=cfg.max_running,
                                   max_tokens_per_forward=cfg.chunk_size + cfg.max_running,
                                   real_kv_sources=self.sources)
            self.mgr.set_sweep_source(self.sweep_source)
            if self.host_tier:
                self.mgr.attach_host_tier(self.num_host_slots)

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

    def nodes(self) -> Iterator[Node]:
        """Every node of the prefix cache (on the device, then those on the host only)."""
        yield from list(self.device_nodes)
        yield from list(self.host_nodes)

    def _place(self, node: Node, page: int) -> None:
        """Set ``node.page`` (``NO_PAGE``: on the host only) and file the node accordingly."""
        node.page = page
        (self.host_nodes if page == NO_PAGE else self.device_nodes)[node] = None
        (self.device_nodes if page == NO_PAGE else self.host_nodes).pop(node, None)

    def cached(self, node: Node) -> bool:
        """Whether ``node`` is still in the prefix cache (a dropped node never comes back)."""
        return node.parent is not None and node.parent.children.get(node.key) is node

    @staticmethod
    def _device_leaf(n: Node) -> bool:
        """On the device with no child there: what device eviction may take (host-only children stay)."""
        return n.on_device and n.lock == 0 and not any(c.on_device for c in n.children.values())

    def evictable_leaves(self) -> list[Node]:
        return [n for n in self.device_nodes if self._device_leaf(n)]

    def evict(self, pages: int) -> int:
        """Free up to ``pages`` device pages by evicting unlocked leaves, least recently used first; with a host
        tier each is backed up (once) and stays cached on the host."""
        heap = [(n.last_access, n.serial, n) for n in self.evictable_leaves()]
        heapq.heapify(heap)
        done = 0
        while heap and done < pages:
            _, _, n = heapq.heappop(heap)
            page = n.page
            if self.host_tier and n.host_page is None:
                n.host_page = self.alloc_host_page()
                if n.host_page is not None:
                    self._pending_backups[n.host_page] = page
            if n.host_page is not None:
                self._place(n, NO_PAGE)
                self.stats["evicted_to_host"] += 1
            else:
                self.drop(n)
            self.free_page(page)
            self.stats["evicted_pages"] += 1
            done += 1
            p = n.parent
            if p is not self.root and self._device_leaf(p):
                heapq.heappush(heap, (p.last_access, p.serial, p))
        self._flush_backups()  # before the freed pages are handed out (and rewritten)
        return done

    def drop(self, node: Node) -> None:
        """Remove ``node`` and its descendants (on the host only, when ``node`` is evicted) from the cache,
        freeing their host pages; the caller frees ``node``'s device page."""
        del node.parent.children[node.key]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not node and n.on_device:
                raise AssertionError("simulator: a node on the device below one being dropped")
            self._release_host_page(n)
            self.device_nodes.pop(n, None)
            self.host_nodes.pop(n, None)

    def evictable_count(self) -> int:
        """Pages that eviction could free: unlocked nodes on the device (a lock covers a node's whole path to the
        root, so every unlocked node can be evicted once its unlocked descendants are)."""
        return sum(1 for n in self.device_nodes if n.lock == 0)

    # ---------------------------------------------------------------- host tier
    def _release_host_page(self, n: Node) -> None:
        if n.host_page is not None:
            self._pending_backups.pop(n.host_page, None)  # (a copy that was never made)
            self.free_host_pages.append(n.host_page)
            n.host_page = None

    def alloc_host_page(self) -> int | None:
        """A free host page, evicting host copies when none is free (None: nothing can be evicted)."""
        if not self.free_host_pages:
            self.evict_host(self.cfg.host_evict_batch)
        return self.free_host_pages.pop() if self.free_host_pages else None

    def evict_host(self, pages: int) -> int:
        """Free up to ``pages`` host pages: unlocked host-only leaves LRU first (dropped from the cache, their
        parents following once childless), then host copies of pages that are on the device again."""
        def host_leaf(n: Node) -> bool:
            return not n.on_device and not n.children and n.lock == 0

        heap = [(n.last_access, n.serial, n) for n in self.host_nodes if host_leaf(n)]
        heapq.heapify(heap)
        done = 0
        while heap and done < pages:
            _, _, n = heapq.heappop(heap)
            self.drop(n)
            done += 1
            p = n.parent
            if p is not self.root and host_leaf(p):
                heapq.heappush(heap, (p.last_access, p.serial, p))
        if done < pages:
            copies = sorted((n for n in self.device_nodes if n.host_page is not None),
                            key=lambda n: (n.last_access, n.serial))
            for n in copies[: pages - done]:
                self._release_host_page(n)
                done += 1
        self.stats["host_evicted_pages"] += done
        return done

    def _flush_backups(self) -> None:
        """Back the pages evicted to the host up: K/V device → host, then the records (one batch)."""
        if not self._pending_backups:
            return
        ps = self.cfg.page_size
        host = [self.slot_of(h, o) for h in self._pending_backups for o in range(ps)]
        dev = [self.slot_of(p, o) for p in self._pending_backups.values() for o in range(ps)]
        self._pending_backups.clear()
        hidx, didx = torch.tensor(host), torch.tensor(dev, device=self.device)
        for buf, host_buf in ((self.k_buf, self.host_k), (self.v_buf, self.host_v)):
            host_buf.view(-1, KV_BYTES).index_copy_(0, hidx, buf.view(self.num_slots, KV_BYTES)[didx].cpu())
        if self.mgr is not None:
            self.mgr.backup_to_host(dev, host)
        self.stats["host_backups"] += len(host) // ps
        self.stats["slots_backed_up"] += len(host)

    def load_back(self, req: Request, nodes: list[Node]) -> None:
        """Bring the host-only ``nodes`` (locked, in path order) back into new device pages."""
        ps = self.cfg.page_size
        pages = [self.alloc_page() for _ in nodes]  # may evict (and back up) other pages, never the locked path
        host = [self.slot_of(n.host_page, o) for n in nodes for o in range(ps)]
        dev = [self.slot_of(p, o) for p in pages for o in range(ps)]
        if self.mgr is not None:
            self.mgr.load_from_host(host, dev)  # the records first: the next forward's verify reads them
        self.load = load = LoadBack(req, nodes, host, dev, torch.tensor(dev, device=self.device))
        self._hook("pre_load")
        hidx = torch.tensor(host)
        for buf, host_buf in ((self.k_buf, self.host_k), (self.v_buf, self.host_v)):
            values = host_buf.view(-1, KV_BYTES).index_select(0, hidx).to(self.device)
            buf.view(self.num_slots, KV_BYTES).index_copy_(0, load.kv_device_slots, values)
        self._hook("post_load")
        self.load = None
        for n, p in zip(nodes, pages, strict=True):
            self._place(n, p)
        self.stats["load_backs"] += 1
        self.stats["slots_loaded_back"] += len(dev)
        for s in dev:  # rewritten, by no request: a serial of its own, so repairs see the slot changed
            self.slot_writers[s] = -self.stats["load_backs"]

    def pin(self, node: Node, by: int = 1) -> None:
        """Lock ``node`` and its path to the root (``by=-1`` unlocks): no eviction moves it (a fault driver keeps
        a corrupted cached page where its detection expects it)."""
        n: Node | None = node
        while n is not None and n is not self.root:
            n.lock += by
            n = n.parent

    def unpin(self, node: Node) -> None:
        self.pin(node, -1)

    def kv_rows(self, seeds: list[int]) -> list[torch.Tensor]:
        """The model's K and V bytes (``[len(seeds), KV_BYTES]`` uint8 each, on the CPU) for the slot seeds."""
        seed = torch.tensor(seeds, dtype=torch.int64)[:, None] ^ (torch.arange(8) * 0x2545F4914F6CDD1D)
        out = []
        for salt in (0, 0x5DEECE66D):
            x = seed ^ salt
            for _ in range(2):  # int64 arithmetic wraps: a cheap deterministic scramble
                x = x ^ (x >> 29)
                x = x * 0xBF58476D1CE4E5B
                x = x ^ (x >> 32)
            out.append(x.view(torch.uint8).reshape(len(seeds), KV_BYTES))
        return out

    def repair_kv(self, nodes: Iterable[Node] | None = None) -> int:
        """Rewrite every copy (device page, host page) of the cached ``nodes`` (default: all) that differs from
        what the model wrote for them; returns the slot copies rewritten (0 when nothing was corrupted). A fault
        driver's repair: a corrupted page may have been backed up or loaded since the injection."""
        todo = [n for n in (self.nodes() if nodes is None else nodes) if self.cached(n)]
        if not todo:
            return 0
        ps, fixed = self.cfg.page_size, 0
        want = self.kv_rows([h >> 1 for n in todo for h in n.hashes])  # the model's seed is the prefix hash >> 1
        for on_host in (False, True):
            rows = [i for i, n in enumerate(todo) if (n.host_page is not None if on_host else n.on_device)]
            if not rows:
                continue
            pages = [todo[i].host_page if on_host else todo[i].page for i in rows]
            idx = torch.tensor([self.slot_of(p, o) for p in pages for o in range(ps)],
                               device="cpu" if on_host else self.device)
            sel = torch.tensor([i * ps + o for i in rows for o in range(ps)])
            bufs = (self.host_k, self.host_v) if on_host else (self.k_buf, self.v_buf)
            for buf, rows_kv in zip(bufs, want, strict=True):
                view, expect = buf.view(-1, KV_BYTES), rows_kv[sel].to(idx.device)
                bad = (view.index_select(0, idx) != expect).any(1)
                if bool(bad.any()):
                    view.index_copy_(0, idx[bad], expect[bad])
                    fixed += int(bad.sum())
        return fixed

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
                hashes = tuple(req.prefix_hash(p) for p in range(d * ps, (d + 1) * ps))
                child = node.children[key] = Node(key, page, d, node, serial=self.nodes_created, hashes=hashes)
                self.device_nodes[child] = None
            elif not child.on_device:  # cached on the host only: our page (the same K/V) is its device copy now
                self._place(child, page)
                self.stats["host_nodes_revived"] += 1
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
        """The cached pages on the device (a host-only node's descendants are host-only too)."""
        slots, prevs, positions = [], [], []
        ps = self.cfg.page_size
        stack = [(c, -1) for c in self.root.children.values() if c.on_device]
        while stack:
            n, prev = stack.pop()
            for o in range(ps):
                s = self.slot_of(n.page, o)
                slots.append(s)
                prevs.append(prev)
                positions.append(n.depth * ps + o)
                prev = s
            stack.extend((c, prev) for c in n.children.values() if c.on_device)
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
        if not self.cfg.kv_sampling:
            return mix(req.rid, len(req.tokens)) % self.cfg.vocab
        return mix(req.rid, len(req.tokens), self.kv_digest(req)) % self.cfg.vocab

    def kv_digest(self, req: Request) -> int:
        """Digest of the K/V ``req`` reads: positions ``0..kv_len-1`` through its ``req_to_token`` row (an entry
        outside the pool reads the padding slot's zeros)."""
        n = req.kv_len
        idx = self.req_to_token[req.row, :n].to(torch.int64)
        idx = torch.where((idx > 0) & (idx < self.num_slots), idx, torch.zeros_like(idx))
        w = self._device_weights[:n]
        total = torch.zeros((), dtype=torch.int64, device=self.device)
        for i, buf in enumerate((self.k_buf, self.v_buf)):
            total += (buf.view(self.num_slots, KV_BYTES).index_select(0, idx).to(torch.int64) * w[:, i]).sum()
        return int(total)

    def clean_tokens(self, rid: int, prompt: list[int], length: int) -> list[int]:
        """The first ``length`` tokens (prompt included) request ``rid`` has over clean K/V (``kv_sampling``):
        what it generates when every slot it reads holds what the model wrote for its own tokens."""
        ref = Request(rid, list(prompt), 0, tokens=list(prompt))
        digest, done = 0, 0
        while len(ref.tokens) < length:
            n = len(ref.tokens)  # positions with K/V when the next token is sampled
            seeds = [ref.prefix_hash(p) >> 1 for p in range(done, n)]
            for i, rows in enumerate(self.kv_rows(seeds)):
                digest += int((rows.to(torch.int64) * self.digest_weights[done:n, i]).sum())
            done = n
            ref.tokens.append(mix(rid, n, digest) % self.cfg.vocab)
        return ref.tokens[:length]

    def output_is_clean(self, req: Request) -> bool:
        """Whether ``req``'s tokens are those it has over clean K/V (``kv_sampling``)."""
        return req.tokens == self.clean_tokens(req.rid, req.tokens[:req.origin_len], len(req.tokens))

    def reserved(self) -> int:
        """Pages running requests may still need (worst case)."""
        ps = self.cfg.page_size
        return sum(-(-(len(r.prompt) + r.max_new) // ps) - len(r.slots) // ps for r in self.running)

    def admit(self, req: Request) -> bool:
        ps = self.cfg.page_size
        path = self.match(req.prompt)
        on_device = sum(n.on_device for n in path)
        need = -(-(len(req.prompt) + req.max_new) // ps) - on_device  # (host-only nodes need device pages)
        if not self.free_rows:
            return False
        want = need + self.reserved() + -(-self.cfg.reserve_tokens // ps)
        if want > len(self.free_pages) and want > len(self.free_pages) + self.evictable_count() - on_device:
            return False
        for n in path:
            n.lock += 1
            n.last_access = self.step_no
        host_only = [n for n in path if not n.on_device]
        if host_only:
            self.load_back(req, host_only)
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
        req.fate = "finished" if cache else "aborted"

    def abort(self, req: Request) -> None:
        """Retire a request without caching it (its own slots go back to the allocator)."""
        if req in self.running:
            self.release(req, cache=False)
            self.stats["aborted"] += 1

    def retract(self, req: Request, keep_len: int) -> Request:
        """Protect mode's recompute: release the running ``req`` without caching its KV and requeue, at the head of
        the waiting queue, a new request with its id that keeps its first ``keep_len`` tokens (never fewer than the
        client's prompt) as its prompt and generates the rest of its output again."""
        keep = max(min(keep_len, len(req.tokens)), req.origin_len)
        again = Request(req.rid, req.tokens[:keep], req.origin_len + req.max_new - keep, tokens=req.tokens[:keep],
                        origin_len=req.origin_len, recomputes=req.recomputes + 1)
        self.release(req, cache=False)
        req.fate = "retracted"
        self.waiting.insert(0, again)
        self.stats["retracted"] += 1
        return again

    def discard(self, node: Node) -> tuple[int, int]:
        """Drop the cached ``node`` and its subtree from the prefix cache, on the device and on the host (nothing is
        backed up); returns (nodes, device pages freed). Every node of the subtree must be unlocked."""
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        pages = 0
        for n in order:
            if n.lock:
                raise AssertionError("simulator: discarding a locked node")
            if n.on_device:
                self._pending_backups = {h: p for h, p in self._pending_backups.items() if p != n.page}
                self.free_page(n.page)
                pages += 1
            self._release_host_page(n)
            self.device_nodes.pop(n, None)
            self.host_nodes.pop(n, None)
        del node.parent.children[node.key]
        for n in order:  # (so that ``cached`` is False for every node of the subtree, not only for ``node``)
            n.children = {}
        self.stats["discarded_nodes"] += len(order)
        return len(order), pages

    def free_slot_early(self, req: Request, pos: int) -> int:
        """The stale-reuse bug: give the (own, page_size 1) slot at ``pos`` back while ``req`` still maps it.

        The slot goes on top of the LIFO free list, so the next allocation hands it to someone else.
        """
        assert self.cfg.page_size == 1
        slot = req.slots[pos]
        req.owned.remove(slot)
        self.free_page(slot)
        return slot

    def can_extend(self, req: Request, extra: int) -> bool:
        """Whether :meth:`extend_life` can keep ``req`` decoding for ``extra`` more tokens (its context has room)."""
        return req.generated + extra <= self.cfg.max_ctx - len(req.prompt) - 1

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
        for buf, values in zip((self.k_buf, self.v_buf), self.kv_rows(seeds), strict=True):
            buf.view(self.num_slots, KV_BYTES).index_copy_(0, idx, values.to(self.device))

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
        if self.mgr is not None and rows:  # writer attribution, as the adapter does when it builds a batch
            self.mgr.assign_requests([r.row for r, _ in rows], [r.rid for r, _ in rows])
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
        self._hook("pre_results")
        for req, n in rows:  # host bookkeeping after the forward
            if req.row == 0:  # retracted or aborted since the batch was built
                continue
            req.kv_len += n
            if req.prefilling:
                continue
            req.tokens.append(self.sample(req))
            req.generated += 1
            if req.generated >= req.max_new:
                self.release(req, cache=True)
                self.stats["finished"] += 1
                if self.cfg.kv_sampling:
                    self.finished.append(req)
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
              device: torch.device | str = "cpu", defer_writes: bool = False) -> Simulator:
    """A simulator driving a fresh ``CanaryManager`` on ``device`` (init finished: the chain-position assert is on).

    ``drain_every=1`` (the default here, not the runtime's) reports each violation after the forward that found
    it, so a fault driver can attribute it to that forward. ``defer_writes``: the manager defers each forward's
    write into the next forward's check launch (``CanaryManager.set_defer_writes``, as an eager engine adapter runs
    it; every simulator forward is eager): a violation the write finds is then reported one forward later. A hook
    that changes K/V bytes, records or ``req_to_token`` outside the manager launches the pending write first
    (``mgr.flush_pending_write()``; :class:`kvcanary.sim.injector.FaultDriver` does).
    """
    from kvcanary.kernels.layout import RealKvHashMode
    from kvcanary.runtime.config import Config
    from kvcanary.runtime.manager import CanaryManager
    from kvcanary.settings import Mode

    config = Config(mode=Mode(mode), real_kv=RealKvHashMode[real_kv.upper()], sweep_interval=sweep_interval,
                    stats_every=0, verify_tokens=sim_cfg.verify_tokens, ring_capacity=4096, drain_every=drain_every)
    # (token_mail: every simulated forward checks after its uploads, as an adapter's plain runner)
    sim = Simulator(sim_cfg, mgr_factory=lambda **kw: CanaryManager(config, token_mail=sim_cfg.token_mail, **kw),
                    hook=hook, device=device)
    sim.mgr.mark_init_finished()
    sim.mgr.set_defer_writes(defer_writes)  # (after init, as an adapter turns it on)
    return sim
