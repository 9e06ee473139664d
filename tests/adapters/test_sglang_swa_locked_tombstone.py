"""sglang 0.5.12's ``SWARadixCache._insert_helper`` frees the full-attention KV slots of an SWA tombstone that a
running request still holds (``full_lock_ref > 0``): a CPU reproduction with the real ``SWARadixCache``,
``SWATokenToKVPoolAllocator``, ``SWAKVPool`` and ``ReqToTokenPool`` (no GPU, no model).

The code (site-packages/sglang/srt/mem_cache/swa_radix_cache.py, 0.5.12), in ``_insert_helper``'s walk::

    if update_kv_after_len < total_prefix_length + prefix_len:
        if node.swa_tombstone:
            assert node.swa_lock_ref == 0, ...
            if swa_evicted_seqlen <= total_prefix_length:
                # Branch 1
                self.token_to_kv_pool_allocator.free(node.value[:prefix_len])      # <- no full_lock_ref check
                node.value = value[:prefix_len].clone()
                node.swa_tombstone = False
                ...
            elif swa_evicted_seqlen < total_prefix_length + prefix_len:
                # Branch 2
                start_update_idx = swa_evicted_seqlen - total_prefix_length
                self.token_to_kv_pool_allocator.free(node.value[start_update_idx:prefix_len])   # <- same
                ...

A tombstone can hold ``full_lock_ref > 0`` in 0.5.12 by two real routes, both exercised here:

* ``window`` (default settings): ``inc_lock_ref`` swa-locks only the last ``sliding_window_size`` tokens of a
  request's path (up to the node ``swa_uuid_for_lock``); the nodes above stay full-locked only, sit in the swa LRU
  list with ``swa_lock_ref == 0``, and ``evict(EvictParams(swa_num_tokens=...))`` tombstones them
  (``_tombstone_internal_node``) while the running request keeps them full-locked.
* ``leaf_release`` (``SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW=1``): ``ScheduleBatch.maybe_evict_swa`` calls
  ``dec_swa_lock_only(req.last_node, req.swa_uuid_for_lock)`` once decode is past the window, which tombstones the
  request's still full-locked leaf on the spot.

Then a request B with the same prefix matches nothing before the tombstone (``_match_prefix_helper`` stops there),
prefills it into fresh slots, and the ``cache_unfinished_req`` after its prefill inserts with
``prev_prefix_len=0, swa_evicted_seqlen=0``: Branch 1 frees the tombstone's old full slots, which request A's
``req_to_token`` row still maps and A's lock still protects. The next allocation hands them to a request C whose
prefill overwrites A's full-attention K/V (what kvcanary saw on the GPU).

Upstream fixed it after 0.5.12 (sglang PR 29352, "skip swa recovery on locked full kv", merged 2026-06-30, in both
this cache and the unified one): for a tombstone with ``full_lock_ref > 0`` the node keeps its full slots, takes the
incoming slots' SWA part through ``full_to_swa_index_mapping`` and only the incoming full slots are freed, so no slot
a lock protects reaches the free list (``integration/pool_phases.py``'s ``swa-lock-fix`` patches that shape into
0.5.12 for the GPU runs; sglang 0.5.23 no longer ships the legacy cache).

These tests document 0.5.12's behaviour: ``test_*_frees_slots_a_running_request_holds`` PASSES while the bug is
present (it asserts the violated invariant is violated); on a fixed sglang it fails at the marked assertion, and
should then be inverted. ``test_an_unlocked_tombstone_takes_the_same_branch_harmlessly`` is the control: the same
branch on a tombstone nobody holds frees nothing anyone holds.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
if importlib.metadata.version("sglang") != "0.5.12":
    pytest.skip("documents the SWARadixCache of sglang 0.5.12 exactly", allow_module_level=True)

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool, SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache  # noqa: E402

WINDOW = 4  # sliding_window_size
FULL_SLOTS = 32  # both pools: A takes 16, B the rest, so the free list then holds only what Branch 1 frees
PREFIX = list(range(100, 108))  # the 8 tokens A and B share: the tombstoned node
A_TAIL = list(range(108, 116))
B_TAIL = list(range(200, 208))


class Serving:
    """sglang's scheduler in miniature over the real pools and SWARadixCache: prefill (match_prefix, lock, alloc,
    req_to_token write), ``cache_unfinished_req`` after each prefill/chunk, ``cache_finished_req`` at the end."""

    def __init__(self, full_slots: int = FULL_SLOTS) -> None:
        self.kv = SWAKVPool(size=full_slots, size_swa=full_slots, page_size=1, dtype=torch.float32, head_num=1,
                            head_dim=2, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
                            enable_kvcache_transpose=False, device="cpu")
        self.alloc = SWATokenToKVPoolAllocator(size=full_slots, size_swa=full_slots, page_size=1,
                                               dtype=torch.float32, device="cpu", kvcache=self.kv, need_sort=False)
        self.req_to_token = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.rows = iter(self.req_to_token.free_slots)  # req_to_token rows, one per request (none is freed here)
        self.tree = SWARadixCache(CacheInitParams(disable=False, req_to_token_pool=self.req_to_token,
                                                  token_to_kv_pool_allocator=self.alloc, page_size=1,
                                                  sliding_window_size=WINDOW))

    def new_req(self, tokens: list[int]) -> types.SimpleNamespace:
        """A ``Req`` with the fields SWARadixCache reads; its prefix matched and locked as PrefillAdder does."""
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        lock = self.tree.inc_lock_ref(match.last_device_node)
        req = types.SimpleNamespace(
            req_pool_idx=next(self.rows), origin_input_ids=list(tokens), output_ids=[],
            fill_ids=[], extra_key=None, prefix_indices=match.device_indices,
            cache_protected_len=len(match.device_indices), last_node=match.last_device_node,
            swa_uuid_for_lock=lock.swa_uuid_for_lock, swa_prefix_lock_released=False, swa_evicted_seqlen=0)
        self.req_to_token.write((req.req_pool_idx, slice(0, len(req.prefix_indices))),
                                req.prefix_indices.to(torch.int32))
        req.pop_committed_kv_cache = lambda: len(req.fill_ids)
        return req

    def prefill(self, req, upto: int) -> torch.Tensor:
        """Extend ``req`` to ``upto`` tokens (one prefill chunk): fresh slots, its row, then cache_unfinished_req."""
        start = max(len(req.fill_ids), len(req.prefix_indices))
        slots = self.alloc.alloc(upto - start)
        assert slots is not None, "pool exhausted"
        self.req_to_token.write((req.req_pool_idx, slice(start, upto)), slots.to(torch.int32))
        req.fill_ids = req.origin_input_ids[:upto]
        self.tree.cache_unfinished_req(req)
        return slots

    def row(self, req, n: int) -> torch.Tensor:
        return self.req_to_token.req_to_token[req.req_pool_idx, :n].to(torch.int64)

    def free_full(self) -> set[int]:
        a = self.alloc.full_attn_allocator
        return set(a.free_pages.tolist()) | set(a.release_pages.tolist())


def full_locked_slots(tree: SWARadixCache) -> set[int]:
    """Every full slot of a node some request holds (``full_lock_ref > 0``)."""
    held, stack = set(), [tree.root_node]
    while stack:
        node = stack.pop()
        if node is not tree.root_node and node.full_lock_ref > 0:
            held |= set(node.value.tolist())
        stack.extend(node.children.values())
    return held


def tombstone_a_full_locked_node(s: Serving, route: str):
    """Request A runs (prefilled, decoding) and its node holding PREFIX becomes an SWA tombstone while A still holds
    its full lock. Returns (A, that node, A's full slots for PREFIX)."""
    if route == "window":
        # chunked prefill in chunks of 8: PREFIX then A_TAIL, two nodes; the swa lock covers only the leaf (8 >= 4)
        a = s.new_req(PREFIX + A_TAIL)
        s.prefill(a, 8)
        s.prefill(a, 16)
        node = a.last_node.parent
        assert node.key.token_ids == PREFIX and node.full_lock_ref == 1 and node.swa_lock_ref == 0
        # SWA pool pressure: the swa LRU's unlocked node is PREFIX's, internal, so it is tombstoned
        evicted = s.tree.evict(EvictParams(num_tokens=0, swa_num_tokens=len(PREFIX)))
        assert evicted.swa_num_tokens_evicted == len(PREFIX) and evicted.num_tokens_evicted == 0
    else:
        # SGLANG_OPT_SWA_RELEASE_LEAF_LOCK_AFTER_WINDOW: maybe_evict_swa once decode is past the window
        a = s.new_req(PREFIX)
        s.prefill(a, 8)
        node = a.last_node
        assert node.key.token_ids == PREFIX and node.full_lock_ref == 1 and node.swa_lock_ref == 1
        s.tree.dec_swa_lock_only(a.last_node, a.swa_uuid_for_lock)
        a.swa_prefix_lock_released = True
    a_slots = s.row(a, len(PREFIX))
    assert torch.equal(node.value, a_slots)
    # step (2) of the scenario: an SWA tombstone that a running request still holds
    assert node.swa_tombstone and node.full_lock_ref > 0
    return a, node, a_slots


@pytest.mark.parametrize("route", ["window", "leaf_release"])
def test_branch1_frees_slots_a_running_request_holds(route: str) -> None:
    s = Serving(FULL_SLOTS if route == "window" else FULL_SLOTS - len(A_TAIL))  # A's tokens + B's: the whole pool
    a, node, a_slots = tombstone_a_full_locked_node(s, route)
    kv = s.kv.full_kv_pool.k_buffer[0]
    kv[a_slots] = 1.0  # A's full-attention K for PREFIX

    # request B, same PREFIX: its match stops before the tombstone, so it prefills PREFIX into fresh slots and the
    # cache_unfinished_req after its prefill inserts with prev_prefix_len=0, swa_evicted_seqlen=0 -> Branch 1
    b = s.new_req(PREFIX + B_TAIL)
    assert len(b.prefix_indices) == 0 and b.last_node is s.tree.root_node
    b_slots = s.prefill(b, len(PREFIX) + len(B_TAIL))
    assert s.alloc.full_available_size() == len(PREFIX)  # B took the rest of the pool: what is free, Branch 1 freed
    assert node.full_lock_ref > 0 and torch.equal(s.row(a, len(PREFIX)), a_slots)  # A still holds, still maps them

    # THE VIOLATED INVARIANT: no full slot a running request holds (its locked row) is on the allocator's free list.
    # sglang 0.5.12 breaks it; a fixed sglang leaves node.value alone for full_lock_ref > 0, and this line fails.
    freed_while_held = set(a_slots.tolist()) & s.free_full()
    assert freed_while_held == set(a_slots.tolist()), "sglang no longer frees a full-locked tombstone's slots"

    # it was Branch 1, on A's node: B's slots adopted, the tombstone revived, and A's lock still stands
    assert torch.equal(node.value, b_slots[: len(PREFIX)]) and not node.swa_tombstone
    assert node.full_lock_ref > 0 and a.last_node.full_lock_ref > 0

    # the consequence: the next allocation (request C) gets A's live slots and its prefill overwrites A's K/V
    c_slots = s.alloc.alloc(len(PREFIX))
    assert set(c_slots.tolist()) == set(a_slots.tolist())
    kv[c_slots] = 2.0  # C's prefill
    assert bool((kv[s.row(a, len(PREFIX))] == 2.0).all())  # A's next decode step reads C's K/V


def test_branch2_has_the_same_shape() -> None:
    """Branch 2 (the tombstone partly inside the incoming request's swa-evicted range) frees
    ``node.value[start_update_idx:prefix_len]`` with the same missing ``full_lock_ref`` check; driven through
    ``insert`` directly with a ``swa_evicted_seqlen`` that falls inside the tombstone."""
    s = Serving()
    a, node, a_slots = tombstone_a_full_locked_node(s, "window")
    b_slots = s.alloc.alloc(len(PREFIX) + len(B_TAIL))
    evicted_seqlen = 5  # B's first 5 tokens' swa slots were freed (ScheduleBatch._evict_swa)
    s.alloc.free_swa(b_slots[:evicted_seqlen])
    s.tree.insert(InsertParams(key=RadixKey(PREFIX + B_TAIL), value=b_slots.clone(), prev_prefix_len=0,
                               swa_evicted_seqlen=evicted_seqlen))
    assert node.full_lock_ref > 0 and torch.equal(s.row(a, len(PREFIX)), a_slots)
    # THE VIOLATED INVARIANT (as above), for A's slots [5:8] of PREFIX; a fixed sglang fails here
    assert set(a_slots[evicted_seqlen:].tolist()) <= s.free_full(), "sglang no longer frees them"
    assert not set(a_slots[:evicted_seqlen].tolist()) & s.free_full()  # the still-tombstoned split part kept


def test_an_unlocked_tombstone_takes_the_same_branch_harmlessly() -> None:
    """Control: A has finished (``cache_finished_req`` released its lock) before PREFIX's node is tombstoned, so
    Branch 1 frees slots no request holds: the node's old slots go back, and nothing locked is on the free list."""
    s = Serving()
    a = s.new_req(PREFIX + A_TAIL)
    s.prefill(a, 8)
    s.prefill(a, 16)
    node = a.last_node.parent
    a_slots = s.row(a, len(PREFIX))
    s.tree.cache_finished_req(a)  # A done: its full (and swa) lock released, the req slot would be freed next
    assert node.full_lock_ref == 0 and a.last_node.full_lock_ref == 0
    s.tree.evict(EvictParams(num_tokens=0, swa_num_tokens=len(PREFIX)))
    assert node.swa_tombstone and node.full_lock_ref == 0

    b = s.new_req(PREFIX + B_TAIL)
    assert len(b.prefix_indices) == 0
    b_slots = s.prefill(b, len(PREFIX) + len(B_TAIL))

    # the same Branch 1: B's slots adopted, the node's old slots freed ...
    assert torch.equal(node.value, b_slots[: len(PREFIX)]) and not node.swa_tombstone
    assert set(a_slots.tolist()) <= s.free_full()
    # ... but the invariant holds: no slot of a full-locked node (B's now) is free, and no running row maps a free one
    assert not full_locked_slots(s.tree) & s.free_full()
    assert not set(s.row(b, len(PREFIX) + len(B_TAIL)).tolist()) & s.free_full()


def _install_switch(name: str, tmp_path, monkeypatch):
    """The GPU driver's test-only switch (integration/pool_phases.py) installed on the real SWARadixCache, and the
    driver's reader of the slot files it writes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
    import pool_phases
    import sglang_e2e

    monkeypatch.setattr(SWARadixCache, "_insert_helper", SWARadixCache._insert_helper)  # restored after the test
    monkeypatch.setenv(pool_phases.POOL_DIR_ENV, str(tmp_path))
    pool_phases.install(name)
    return lambda: sglang_e2e.read_jsonl(pool_phases.swa_lock_files(str(tmp_path)))


@pytest.mark.parametrize("fix", [False, True], ids=["observe", "fix"])
def test_e2e_swa_lock_switch_records_and_fixes_the_free(fix: bool, tmp_path, monkeypatch) -> None:
    """Phases 29/30's switch on Branch 1: it records the held slots Branch 1 frees; with the fix (PR 29352's shape)
    the locked node keeps them and takes B's swa slots, and only B's duplicate full slots are freed: nothing held
    is free, nothing leaks."""
    events = _install_switch("swa-lock-fix" if fix else "swa-lock", tmp_path, monkeypatch)
    s = Serving(FULL_SLOTS)
    a, node, a_slots = tombstone_a_full_locked_node(s, "window")
    b = s.new_req(PREFIX + B_TAIL)
    b_slots = s.prefill(b, len(PREFIX) + len(B_TAIL))
    assert [(e["branch"], sorted(e["slots"])) for e in events()] == [(1, sorted(a_slots.tolist()))]
    freed_while_held = set(a_slots.tolist()) & s.free_full()
    assert freed_while_held == (set() if fix else set(a_slots.tolist()))
    assert vars(s.alloc).get("free") is None  # the per-insert wrapper is gone again
    assert s.alloc.full_available_size() == len(PREFIX)  # nothing leaks: one prefix's worth is free either way
    if fix:  # the node keeps A's full slots, now with B's swa slots; B's duplicate full slots are the free ones
        assert torch.equal(node.value, a_slots) and not node.swa_tombstone
        assert s.free_full() == set(b_slots[: len(PREFIX)].tolist())
        swa = s.alloc.full_to_swa_index_mapping
        assert bool((swa[a_slots] > 0).all()) and bool((swa[b_slots[: len(PREFIX)]] == 0).all())
        assert torch.equal(s.row(b, len(PREFIX)), a_slots)  # B's row now maps the tree's (A's) slots


@pytest.mark.parametrize("fix", [False, True], ids=["observe", "fix"])
def test_e2e_swa_lock_switch_fixes_a_branch1_free_after_a_split(fix: bool, tmp_path, monkeypatch) -> None:
    """B shares only PREFIX[:6]: the walk first splits the tombstone (a new node object, locked like it) and Branch 1
    then frees that new node's value; the switch finds it at free time, not in a list taken before the insert."""
    events = _install_switch("swa-lock-fix" if fix else "swa-lock", tmp_path, monkeypatch)
    s = Serving(FULL_SLOTS)
    a, node, a_slots = tombstone_a_full_locked_node(s, "window")
    shared = 6
    b = s.new_req(PREFIX[:shared] + B_TAIL)
    b_slots = s.prefill(b, shared + len(B_TAIL))
    head = node.parent  # the split's new node: PREFIX[:6], still full-locked by A
    assert head.key.token_ids == PREFIX[:shared] and head.full_lock_ref > 0
    assert [(e["branch"], sorted(e["slots"])) for e in events()] == [(1, sorted(a_slots[:shared].tolist()))]
    assert set(a_slots.tolist()) & s.free_full() == (set() if fix else set(a_slots[:shared].tolist()))
    assert s.alloc.full_available_size() == FULL_SLOTS - 16 - len(B_TAIL)  # A's 16 and B's tail held; no leak
    if fix:
        assert torch.equal(head.value, a_slots[:shared]) and not head.swa_tombstone
        assert set(b_slots[:shared].tolist()) <= s.free_full()  # B's duplicates (besides the 2 never allocated)


@pytest.mark.parametrize("fix", [False, True], ids=["observe", "fix"])
def test_e2e_swa_lock_switch_fixes_branch2(fix: bool, tmp_path, monkeypatch) -> None:
    """Branch 2 (as in ``test_branch2_has_the_same_shape``): sglang frees the locked node's tail
    ``value[5:8]``, splits the node there and gives the tail part B's slots. With the fix the tail part keeps A's
    full slots with B's swa slots, B's duplicate full slots for it are freed, and the head stays a tombstone."""
    events = _install_switch("swa-lock-fix" if fix else "swa-lock", tmp_path, monkeypatch)
    s = Serving()
    a, node, a_slots = tombstone_a_full_locked_node(s, "window")
    b_slots = s.alloc.alloc(len(PREFIX) + len(B_TAIL))
    evicted_seqlen = 5
    s.alloc.free_swa(b_slots[:evicted_seqlen])
    s.tree.insert(InsertParams(key=RadixKey(PREFIX + B_TAIL), value=b_slots.clone(), prev_prefix_len=0,
                               swa_evicted_seqlen=evicted_seqlen))
    assert [(e["branch"], sorted(e["slots"])) for e in events()] == [(2, sorted(a_slots[evicted_seqlen:].tolist()))]
    held_free = set(a_slots.tolist()) & s.free_full()
    assert held_free == (set() if fix else set(a_slots[evicted_seqlen:].tolist()))
    assert node.key.token_ids == PREFIX[evicted_seqlen:] and not node.swa_tombstone  # the split's tail part
    assert node.parent.swa_tombstone and torch.equal(node.parent.value, a_slots[:evicted_seqlen])
    # B's head (swa already evicted) goes back either way; with the fix also B's full slots for the tail part
    expect_free = set(b_slots[:evicted_seqlen].tolist()) | (set(b_slots[evicted_seqlen:len(PREFIX)].tolist())
                                                            if fix else set(a_slots[evicted_seqlen:].tolist()))
    assert s.free_full() == expect_free
    if fix:
        assert torch.equal(node.value, a_slots[evicted_seqlen:])
        swa = s.alloc.full_to_swa_index_mapping
        assert bool((swa[node.value] > 0).all()) and bool((swa[b_slots[evicted_seqlen:len(PREFIX)]] == 0).all())
