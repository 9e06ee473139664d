"""The settings audit: every sglang 0.5.12 ``ServerArgs`` setting that moves KV or changes how slots map to tokens.

Rule (issue 24): no sglang setting may lead to silent false positives or silently unverified KV. So each setting
below is *covered* (a test in this repository exercises it with kvcanary installed: ``test`` names it and
``tests/adapters/test_audit.py`` checks the node exists), *refused* at start-up by
:func:`kvcanary.sglang.guards.check_supported` with an error naming the flag as the user writes it, or has
*no KV effect* (considered, and it neither moves KV nor remaps slots; ``why`` says why). A setting with no test
that a CPU machine can run is refused, not called covered.

The table is the single source: the start-up guards evaluate its refused rows, ``kvcanary check`` evaluates every
row, and ``docs/settings.md`` and the README's short table are generated from it
(``python -m kvcanary.sglang.audit --markdown`` / ``--readme``; a test fails when they drift).

Read from sglang 0.5.12's ``srt/server_args.py`` (the ``ServerArgs`` fields and ``add_cli_args``). Rows whose
field another version lacks read as their default (``getattr`` with one), so the same table serves 0.5.23.
"""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class Verdict(str, enum.Enum):
    COVERED = "covered"
    REFUSED = "refused"
    NO_KV_EFFECT = "no_kv_effect"

    @property
    def label(self) -> str:
        return "no KV effect" if self is Verdict.NO_KV_EFFECT else self.value


# Who raises a refused row at start-up: the guards' own loop, or speculative.check_speculative (whose decisions and
# messages stay its own; its rows mirror them and tests/adapters/test_audit.py holds the two together).
GUARDS = "guards"
CHECK_SPECULATIVE = "check_speculative"

# sglang versions whose HiCache host tier kvcanary follows (records backed up and loaded back with the KV).
HICACHE_VERSIONS = ("0.5.12",)

Predicate = Callable[[Any, str], bool]  # (server_args, sglang_version) -> the row applies


@dataclass(frozen=True)
class Setting:
    """One audited setting: when it applies, the verdict, why, and the test (covered) or the message (refused)."""

    field: str  # the ServerArgs field
    flag: str  # the launch_server flag, as the user writes it
    verdict: Verdict
    applies: Predicate
    when: str  # the predicate in words (the docs' "applies when" column)
    why: str
    test: str = ""  # covered: the tests/...::test_name node that exercises it
    # refused: the error, formatted with {written} (the flag as written, with its value), {value}, {version};
    # it names the flag and says what to change
    refusal: str = ""
    # refused: ServerArgs fields that make the row apply (the guards' test sets them on accepted arguments)
    example: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    raised_by: str = GUARDS

    def written(self, server_args) -> str:
        """The flag as the user wrote it: ``--enable-pdmux``, ``--page-size 16``."""
        value = getattr(server_args, self.field, None)
        if value is True or value is None:
            return self.flag
        return f"{self.flag} {getattr(value, 'name', value)}"

    def message(self, server_args, sglang_version: str) -> str:
        value = getattr(server_args, self.field, None)
        return self.refusal.format(written=self.written(server_args), value=getattr(value, "name", value),
                                   version=sglang_version)


@dataclass(frozen=True)
class Finding:
    """One row evaluated against server arguments (``kvcanary check``)."""

    setting: Setting
    applies: bool
    written: str

    @property
    def verdict(self) -> Verdict:
        return self.setting.verdict


# ----------------------------------------------------------------------------------------------- predicates
def _get(sa, name: str, default: object = None) -> Any:
    return getattr(sa, name, default)


def truthy(name: str) -> Predicate:
    return lambda sa, v: bool(_get(sa, name))


def one_of(name: str, *values: object) -> Predicate:
    return lambda sa, v: _get(sa, name) in values


def greater(name: str, bound: float, default: float = 0) -> Predicate:
    return lambda sa, v: float(_get(sa, name, default) or default) > bound


def _hicache(sa) -> bool:
    return bool(_get(sa, "enable_hierarchical_cache"))


def _spec_name(sa) -> str:
    algo = _get(sa, "speculative_algorithm")
    return str(getattr(algo, "name", algo)).upper() if algo else ""


def _spec_topk(sa) -> int:
    return int(_get(sa, "speculative_eagle_topk") or 1)


def _spec_on(sa, version: str) -> bool:
    """Speculative decoding past check_speculative's version test (its later checks only run then)."""
    from kvcanary.sglang.speculative import COVERED_VERSIONS

    return bool(_get(sa, "speculative_algorithm")) and version in COVERED_VERSIONS


def _eagle_covered(sa, version: str) -> bool:
    from kvcanary.sglang.speculative import SUPPORTED_ALGORITHMS

    return (_spec_on(sa, version) and _spec_topk(sa) <= 1 and _spec_name(sa) in SUPPORTED_ALGORITHMS
            and not _get(sa, "disable_overlap_schedule") and not _get(sa, "enable_multi_layer_eagle")
            and not _get(sa, "speculative_adaptive"))


def _own_canary(sa, version: str) -> bool:
    return _get(sa, "kv_canary") not in (None, False, "none", "off", "")


E2E = "tests/adapters/test_sglang_e2e.py::test_real_engine_clean_run_then_detections"
HICACHE_TEST = "tests/adapters/test_sglang_hicache.py::test_records_follow_backup_and_load_back"
EAGLE_TEST = "tests/adapters/test_sglang_eagle.py::test_installs_one_manager_per_pool_and_draft_replays_step_it"
UNTESTED = "no test exercises kvcanary with it"

C, R, N = Verdict.COVERED, Verdict.REFUSED, Verdict.NO_KV_EFFECT
# (its engine fixture's "fp8" case: a real ModelRunner with --kv-cache-dtype fp8_e4m3)
FP8_TEST = "tests/adapters/test_sglang_pool_kinds.py::test_pool_kind_clean_run_then_real_kv_flip"
SPEC_EXAMPLE = {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1, "speculative_num_steps": 2,
                "speculative_num_draft_tokens": 3, "speculative_draft_model_path": "draft"}

SETTINGS: tuple[Setting, ...] = (
    # --- start-up refusals kept from before the audit (their messages unchanged)
    Setting("kv_canary", "--kv-canary", R, _own_canary, "not none/off (sglang 0.5.23+)",
            "sglang's own KV canary would run beside kvcanary's on the same slots",
            refusal="sglang's own KV canary is enabled (--kv-canary {value}); kvcanary does not install twice: "
                    "drop --kv-canary or unset KVCANARY_MODE",
            example={"kv_canary": "log"}),
    Setting("enable_torch_compile", "--enable-torch-compile", R, truthy("enable_torch_compile"), "set",
            "compiles the whole model.forward: kvcanary's wrapper only calls through while torch.compile traces it, "
            "so the decode graphs would carry no canary",
            refusal="--enable-torch-compile compiles model.forward, which kvcanary wraps; remove "
                    "--enable-torch-compile",
            example={"enable_torch_compile": True}),
    Setting("enable_pdmux", "--enable-pdmux", R, truthy("enable_pdmux"), "set",
            "split prefill runs model.forward_split_prefill, which bypasses kvcanary's wrapper",
            refusal="split prefill (--enable-pdmux) calls model.forward_split_prefill, which bypasses kvcanary; "
                    "remove --enable-pdmux",
            example={"enable_pdmux": True}),
    # --- HiCache (the host KV tier)
    Setting("enable_hierarchical_cache", "--enable-hierarchical-cache", C,
            lambda sa, v: _hicache(sa) and v in HICACHE_VERSIONS and not _get(sa, "speculative_algorithm"),
            "set, sglang 0.5.12, no speculative decoding",
            "records and writer rows are backed up to the host tier and loaded back with the KV "
            "(kvcanary.runtime.host_tier)", test=HICACHE_TEST),
    Setting("enable_hierarchical_cache", "--enable-hierarchical-cache", R,
            lambda sa, v: _hicache(sa) and v not in HICACHE_VERSIONS, "set, sglang other than 0.5.12",
            "kvcanary follows the host tier's backups and loads on sglang 0.5.12 only",
            refusal="HiCache (--enable-hierarchical-cache) is covered by kvcanary on sglang "
                    f"{', '.join(HICACHE_VERSIONS)} only, not {{version}}: KV loaded back from the host tier would "
                    "land in slots without its records; remove --enable-hierarchical-cache or unset KVCANARY_MODE",
            example={"enable_hierarchical_cache": True}),
    Setting("enable_hierarchical_cache", "--enable-hierarchical-cache", R,
            lambda sa, v: _hicache(sa) and bool(_get(sa, "speculative_algorithm")),
            "set together with --speculative-algorithm",
            "the draft pool's host copies are not followed: a draft slot loaded back would carry stale records",
            refusal="HiCache (--enable-hierarchical-cache) with speculative decoding (--speculative-algorithm): "
                    "kvcanary does not follow the draft pool's host copies; remove --enable-hierarchical-cache or "
                    "--speculative-algorithm",
            example={"enable_hierarchical_cache": True, **SPEC_EXAMPLE}),
    Setting("hicache_write_policy", "--hicache-write-policy", C,
            lambda sa, v: _hicache(sa) and _get(sa, "hicache_write_policy") in (
                "write_through", "write_through_selective", "write_back"),
            "HiCache on: write_through, write_through_selective, write_back",
            "each policy only decides when a backup runs; the records follow every backup", test=HICACHE_TEST),
    Setting("hicache_io_backend", "--hicache-io-backend", C,
            lambda sa, v: _hicache(sa) and _get(sa, "hicache_io_backend") in ("kernel", "direct"),
            "HiCache on: kernel, direct",
            "the records are copied by kvcanary beside whichever copy moves the KV", test=HICACHE_TEST),
    Setting("hicache_io_backend", "--hicache-io-backend", R,
            lambda sa, v: _hicache(sa) and _get(sa, "hicache_io_backend") not in ("kernel", "direct"),
            "HiCache on: kernel_ascend", f"an NPU copy path; {UNTESTED}",
            refusal="{written}: kvcanary follows HiCache's kernel and direct copies only; use --hicache-io-backend "
                    "kernel or direct, or unset KVCANARY_MODE",
            example={"enable_hierarchical_cache": True, "hicache_io_backend": "kernel_ascend"}),
    Setting("hicache_mem_layout", "--hicache-mem-layout", C, lambda sa, v: _hicache(sa), "HiCache on: every layout",
            "the host layout is the KV's; the records' host copy is kvcanary's own", test=HICACHE_TEST),
    Setting("hicache_ratio", "--hicache-ratio", N, lambda sa, v: _hicache(sa), "HiCache on", "sizes the host pool"),
    Setting("hicache_size", "--hicache-size", N, lambda sa, v: _hicache(sa) and bool(_get(sa, "hicache_size")),
            "HiCache on, > 0", "sizes the host pool"),
    Setting("hicache_storage_backend", "--hicache-storage-backend", R,
            lambda sa, v: _get(sa, "hicache_storage_backend") is not None, "set",
            "the L3 storage tier prefetches KV into host slots with no record",
            refusal="{written}: HiCache's storage tier loads KV into host slots that carry no kvcanary record; "
                    "remove --hicache-storage-backend or unset KVCANARY_MODE",
            example={"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}),
    Setting("disaggregation_decode_enable_offload_kvcache", "--disaggregation-decode-enable-offload-kvcache", R,
            truthy("disaggregation_decode_enable_offload_kvcache"), "set",
            "decode-side KV offload to the storage tier: KV comes back with no record",
            refusal="--disaggregation-decode-enable-offload-kvcache offloads decode KV to storage and loads it back "
                    "without kvcanary's records; remove it or unset KVCANARY_MODE",
            example={"disaggregation_decode_enable_offload_kvcache": True}),
    Setting("enable_hisparse", "--enable-hisparse", R, truthy("enable_hisparse"), "set",
            "hierarchical sparse attention swaps KV between device and host per token",
            refusal="--enable-hisparse moves KV between device and host slots that kvcanary does not follow; "
                    "remove --enable-hisparse or unset KVCANARY_MODE",
            example={"enable_hisparse": True}),
    Setting("enable_lmcache", "--enable-lmcache", R, truthy("enable_lmcache"), "set",
            "LMCache loads KV from its own store into slots with no record",
            refusal="--enable-lmcache loads KV from LMCache into slots that carry no kvcanary record; remove "
                    "--enable-lmcache or unset KVCANARY_MODE",
            example={"enable_lmcache": True}),
    Setting("disaggregation_mode", "--disaggregation-mode", R, lambda sa, v: _get(sa, "disaggregation_mode",
            "null") not in ("null", None), "prefill or decode",
            "KV is transferred between the prefill and decode instances: the decode side's slots are written "
            f"without records; {UNTESTED}",
            refusal="{written}: KV transferred between prefill and decode instances lands in slots that carry no "
                    "kvcanary record; remove --disaggregation-mode or unset KVCANARY_MODE",
            example={"disaggregation_mode": "prefill"}),
    Setting("prefill_only_disable_kv_cache", "--prefill-only-disable-kv-cache", R,
            truthy("prefill_only_disable_kv_cache"), "set",
            "no KV is stored, so the records would describe slots nobody wrote",
            refusal="--prefill-only-disable-kv-cache stores no KV, so kvcanary's records would describe slots "
                    "nobody wrote; remove it or unset KVCANARY_MODE",
            example={"prefill_only_disable_kv_cache": True}),
    # --- layout and scheduling
    Setting("page_size", "--page-size", C, greater("page_size", 1, 1), "> 1",
            "pages only group consecutive slots; e2e runs page 1 and 16", test=E2E),
    Setting("kv_cache_dtype", "--kv-cache-dtype", C, one_of("kv_cache_dtype", "bf16", "bfloat16"), "bf16",
            "the CPU engine's KV is bf16", test=E2E),
    Setting("kv_cache_dtype", "--kv-cache-dtype", C, one_of("kv_cache_dtype", "fp8_e4m3", "fp8_e5m2"),
            "fp8_e4m3, fp8_e5m2",
            "one byte per element, stored as uint8: the real-KV fingerprint hashes those bytes (H200, fp8_e4m3: clean "
            "0, every fault class found, outputs identical on and off)", test=FP8_TEST),
    Setting("kv_cache_dtype", "--kv-cache-dtype", R,
            lambda sa, v: _get(sa, "kv_cache_dtype", "auto") not in ("auto", "bf16", "bfloat16", "fp8_e4m3",
                                                                    "fp8_e5m2"),
            "fp4_e2m1 (or another quantised store)",
            f"packed fp4 values with separate scales; {UNTESTED} on the real-KV fingerprint",
            refusal="{written}: kvcanary's real-KV fingerprint has not been tested on this quantised KV store; use "
                    "--kv-cache-dtype auto, bf16, fp8_e4m3 or fp8_e5m2, or unset KVCANARY_MODE",
            example={"kv_cache_dtype": "fp4_e2m1"}),
    Setting("disable_radix_cache", "--disable-radix-cache", C, truthy("disable_radix_cache"), "set",
            "a ChunkCache: no prefix sharing, nothing to sweep; the EAGLE run uses it",
            test="tests/adapters/test_sglang_eagle.py::test_with_the_upstream_fix_nothing_is_reported"),
    Setting("chunked_prefill_size", "--chunked-prefill-size", C, lambda sa, v: _get(sa, "chunked_prefill_size")
            is not None, "set", "chunked extends continue a row's chain; e2e chunks at 48 tokens", test=E2E),
    Setting("enable_dynamic_chunking", "--enable-dynamic-chunking", N, truthy("enable_dynamic_chunking"), "set",
            "moves chunk boundaries only (chunked prefill is covered)"),
    Setting("enable_mixed_chunk", "--enable-mixed-chunk", C, truthy("enable_mixed_chunk"), "set",
            "MIXED batches (a chunked extend and the running decodes in one forward) are planned per row like an "
            "extend", test="tests/adapters/test_sglang_mixed_chunk.py::"
                            "test_mixed_forwards_are_verified_clean_and_catch_a_corruption"),
    Setting("schedule_conservativeness", "--schedule-conservativeness", C,
            lambda sa, v: float(_get(sa, "schedule_conservativeness", 1.0)) != 1.0, "!= 1.0",
            "more or fewer retractions; a retracted row's tokens are sent whole again",
            test="tests/adapters/test_tokens.py::test_a_retracted_row_is_sent_whole_again"),
    Setting("enable_priority_scheduling", "--enable-priority-scheduling", C, truthy("enable_priority_scheduling"),
            "set", "preemption retracts requests like memory pressure does",
            test="tests/adapters/test_tokens.py::test_a_retracted_row_is_sent_whole_again"),
    Setting("radix_eviction_policy", "--radix-eviction-policy", N, lambda sa, v: _get(sa, "radix_eviction_policy",
            "lru") != "lru", "not lru", "chooses which cached prefixes are evicted, not how slots map"),
    Setting("enable_streaming_session", "--enable-streaming-session", R, truthy("enable_streaming_session"), "set",
            f"a session keeps its KV between requests; {UNTESTED}",
            refusal="--enable-streaming-session keeps KV across a session's requests, which kvcanary has not been "
                    "tested with; remove --enable-streaming-session or unset KVCANARY_MODE",
            example={"enable_streaming_session": True}),
    Setting("enable_memory_saver", "--enable-memory-saver", R, truthy("enable_memory_saver"), "set",
            f"releases and re-maps the KV pool's memory under the records; {UNTESTED} (CUDA only)",
            refusal="--enable-memory-saver releases and restores the KV pool's memory under kvcanary's records; "
                    "remove --enable-memory-saver or unset KVCANARY_MODE",
            example={"enable_memory_saver": True}),
    Setting("disable_hybrid_swa_memory", "--disable-hybrid-swa-memory", C, truthy("disable_hybrid_swa_memory"),
            "set", "a sliding-window model then keeps every layer in one MHA pool", test=E2E),
    Setting("swa_full_tokens_ratio", "--swa-full-tokens-ratio", N,
            lambda sa, v: float(_get(sa, "swa_full_tokens_ratio", 0.8)) != 0.8, "!= 0.8",
            "sizes the SWA pool; SWAKVPool itself is checked at install "
            "(tests/adapters/test_sglang_hooks.py::test_swa_pool_gives_full_and_swa_groups_with_the_lut)"),
    Setting("max_mamba_cache_size", "--max-mamba-cache-size", N, lambda sa, v: _get(sa, "max_mamba_cache_size")
            is not None, "set", "sizes the Mamba state pool, which holds no KV; a hybrid model's KV pool is "
            "checked at install by class (an unknown pool is refused, naming it)"),
    Setting("mamba_scheduler_strategy", "--mamba-scheduler-strategy", N,
            lambda sa, v: _get(sa, "mamba_scheduler_strategy", "auto") != "auto", "not auto",
            "moves Mamba states, not KV slots"),
    Setting("dllm_algorithm", "--dllm-algorithm", R, lambda sa, v: _get(sa, "dllm_algorithm") is not None, "set",
            "diffusion LLM forwards (DLLM_EXTEND) rewrite a block's slots in place",
            refusal="{written}: diffusion LLM forwards rewrite KV slots in place, which kvcanary does not cover; "
                    "remove --dllm-algorithm or unset KVCANARY_MODE",
            example={"dllm_algorithm": "LowConfidence"}),
    # --- graphs and compilation
    Setting("disable_cuda_graph", "--disable-cuda-graph", C, truthy("disable_cuda_graph"), "set",
            "eager decode: every CPU test runs this way", test=E2E),
    Setting("disable_piecewise_cuda_graph", "--disable-piecewise-cuda-graph", C,
            truthy("disable_piecewise_cuda_graph"), "set", "eager prefill", test=E2E),
    Setting("piecewise_cuda_graph_compiler", "--piecewise-cuda-graph-compiler", N,
            lambda sa, v: _get(sa, "piecewise_cuda_graph_compiler", "eager") != "eager", "not eager",
            "compiles the layer stack inside kvcanary's wrapper, never the wrapper "
            "(tests/adapters/test_sglang_piecewise.py::test_nothing_of_kvcanary_is_traced_into_the_compiled_layer_"
            "stack)"),
    Setting("enable_breakable_cuda_graph", "--enable-breakable-cuda-graph", R,
            lambda sa, v: v == "0.5.12" and bool(_get(sa, "enable_breakable_cuda_graph")), "set (sglang 0.5.12)",
            f"serves prefill from the experimental BreakableCudaGraphRunner; {UNTESTED}",
            refusal="--enable-breakable-cuda-graph serves prefill from a graph runner kvcanary has not been tested "
                    "with; remove --enable-breakable-cuda-graph or pass --disable-piecewise-cuda-graph",
            example={"enable_breakable_cuda_graph": True}),
    Setting("num_continuous_decode_steps", "--num-continuous-decode-steps", N,
            greater("num_continuous_decode_steps", 1, 1), "> 1", "not read by sglang 0.5.12's scheduler"),
    # --- parallelism
    Setting("tp_size", "--tp-size", C, greater("tp_size", 1, 1), "> 1",
            "one canary per rank over its own KV shard",
            test="tests/adapters/test_sglang_tp.py::test_tp2_clean_phase_zero_violations_counters_advance_on_both_"
                 "ranks"),
    Setting("pp_size", "--pp-size", R, greater("pp_size", 1, 1), "> 1",
            f"pipeline stages run micro-batches over their own layers; only the rank naming is tested, {UNTESTED}",
            refusal="{written}: pipeline parallelism has not been tested with kvcanary (only its rank naming is); "
                    "use --pp-size 1 or unset KVCANARY_MODE",
            example={"pp_size": 2}),
    Setting("dp_size", "--dp-size", N, lambda sa, v: int(_get(sa, "dp_size", 1) or 1) > 1
            and not _get(sa, "enable_dp_attention"), "> 1 without DP attention",
            "independent replicas, one canary each, named by dp_rank"),
    Setting("enable_dp_attention", "--enable-dp-attention", R, truthy("enable_dp_attention"), "set",
            f"attention-DP ranks run IDLE forwards and gathered batches; only the rank naming is tested, {UNTESTED}",
            refusal="--enable-dp-attention has not been tested with kvcanary (only its rank naming is); remove "
                    "--enable-dp-attention or unset KVCANARY_MODE",
            example={"enable_dp_attention": True}),
    Setting("attn_cp_size", "--attn-cp-size", R, greater("attn_cp_size", 1, 1), "> 1",
            f"attention context parallelism splits a sequence's KV across ranks; {UNTESTED}",
            refusal="{written}: attention context parallelism splits a sequence's KV across ranks, which kvcanary "
                    "does not cover; remove --attn-cp-size or unset KVCANARY_MODE",
            example={"attn_cp_size": 2}),
    Setting("enable_prefill_context_parallel", "--enable-prefill-context-parallel", R,
            truthy("enable_prefill_context_parallel"), "set", f"splits a prefill's KV across ranks; {UNTESTED}",
            refusal="--enable-prefill-context-parallel splits a prefill's KV across ranks, which kvcanary does not "
                    "cover; remove it or unset KVCANARY_MODE",
            example={"enable_prefill_context_parallel": True}),
    Setting("enable_nsa_prefill_context_parallel", "--enable-nsa-prefill-context-parallel", R,
            truthy("enable_nsa_prefill_context_parallel"), "set", f"splits a prefill's KV across ranks; {UNTESTED}",
            refusal="--enable-nsa-prefill-context-parallel splits a prefill's KV across ranks, which kvcanary does "
                    "not cover; remove it or unset KVCANARY_MODE",
            example={"enable_nsa_prefill_context_parallel": True}),
    Setting("enable_two_batch_overlap", "--enable-two-batch-overlap", R, truthy("enable_two_batch_overlap"), "set",
            f"splits each forward into two interleaved micro-batches; {UNTESTED}",
            refusal="--enable-two-batch-overlap runs each forward as two interleaved micro-batches, which kvcanary "
                    "has not been tested with; remove --enable-two-batch-overlap or unset KVCANARY_MODE",
            example={"enable_two_batch_overlap": True}),
    Setting("enable_single_batch_overlap", "--enable-single-batch-overlap", N,
            truthy("enable_single_batch_overlap"), "set", "overlaps MoE communication with compute; no KV"),
    Setting("disable_overlap_schedule", "--disable-overlap-schedule", C,
            lambda sa, v: bool(_get(sa, "disable_overlap_schedule")) and not _get(sa, "speculative_algorithm"),
            "set, no speculative decoding", "one batch at a time, as the CPU test loop runs", test=E2E),
    # --- speculative decoding (raised by speculative.check_speculative, in its order)
    Setting("speculative_algorithm", "--speculative-algorithm", C, _eagle_covered,
            "EAGLE, --speculative-eagle-topk 1, spec v2, sglang 0.5.12",
            "one manager per pool (target, draft), verify and draft extend planned per row; on MHA pools: over an "
            "MLA or sliding-window pool the install refuses it (speculative.check_pool_kind)", test=EAGLE_TEST),
    Setting("speculative_algorithm", "--speculative-algorithm", R,
            lambda sa, v: bool(_get(sa, "speculative_algorithm")) and not _spec_on(sa, v),
            "set, sglang other than 0.5.12", "EAGLE's hook targets are checked on 0.5.12 only",
            example=SPEC_EXAMPLE, raised_by=CHECK_SPECULATIVE),
    Setting("speculative_eagle_topk", "--speculative-eagle-topk", R,
            lambda sa, v: _spec_on(sa, v) and _spec_topk(sa) > 1, "> 1",
            "a draft tree: sglang moves the accepted path to other slots",
            example={**SPEC_EXAMPLE, "speculative_eagle_topk": 4}, raised_by=CHECK_SPECULATIVE),
    Setting("speculative_algorithm", "--speculative-algorithm", R,
            lambda sa, v: _spec_on(sa, v) and _spec_topk(sa) <= 1 and _spec_name(sa) != "EAGLE",
            "not EAGLE (STANDALONE, EAGLE3, NGRAM, DFLASH, ...)", "other draft workers are not covered",
            example={**SPEC_EXAMPLE, "speculative_algorithm": "STANDALONE"}, raised_by=CHECK_SPECULATIVE),
    Setting("disable_overlap_schedule", "--disable-overlap-schedule", R,
            lambda sa, v: _spec_on(sa, v) and bool(_get(sa, "disable_overlap_schedule")),
            "set with speculative decoding", "spec v1 moves accepted KV between slots",
            example={**SPEC_EXAMPLE, "disable_overlap_schedule": True}, raised_by=CHECK_SPECULATIVE),
    Setting("enable_multi_layer_eagle", "--enable-multi-layer-eagle", R,
            lambda sa, v: _spec_on(sa, v) and bool(_get(sa, "enable_multi_layer_eagle")), "set",
            "another draft worker (MultiLayerEagleWorkerV2)",
            example={**SPEC_EXAMPLE, "enable_multi_layer_eagle": True}, raised_by=CHECK_SPECULATIVE),
    Setting("speculative_adaptive", "--speculative-adaptive", R,
            lambda sa, v: _spec_on(sa, v) and bool(_get(sa, "speculative_adaptive")), "set",
            "swaps the draft step count and its graphs at run time",
            example={**SPEC_EXAMPLE, "speculative_adaptive": True}, raised_by=CHECK_SPECULATIVE),
    # --- considered, no KV effect
    Setting("enable_lora", "--enable-lora", N, lambda sa, v: bool(_get(sa, "enable_lora") or _get(sa, "lora_paths")),
            "set, or --lora-paths given",
            "adapters change what K/V hold, not which slot holds which token; the prefix cache keys by adapter"),
    Setting("enable_deterministic_inference", "--enable-deterministic-inference", N,
            truthy("enable_deterministic_inference"), "set", "fixes kernel split sizes; slots are unchanged"),
    Setting("strip_thinking_cache", "--strip-thinking-cache", N, truthy("strip_thinking_cache"), "set",
            "a finished request with reasoning commits only its prompt to the prefix cache and frees the rest as "
            "over-allocated KV; no live slot moves"),
    Setting("speculative_attention_mode", "--speculative-attention-mode", N,
            one_of("speculative_attention_mode", "decode"), "decode",
            "which attention backend runs target verify and draft extend; the slots they write are the same"),
    Setting("enable_weights_cpu_backup", "--enable-weights-cpu-backup", N, truthy("enable_weights_cpu_backup"),
            "set", "weights only"),
    Setting("cpu_offload_gb", "--cpu-offload-gb", N, greater("cpu_offload_gb", 0), "> 0", "weights only"),
    Setting("kv_events_config", "--kv-events-config", N, lambda sa, v: _get(sa, "kv_events_config") is not None,
            "set", "publishes cache events; moves nothing"),
)


# ----------------------------------------------------------------------------------------------- evaluation
def refused_rows() -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.verdict is Verdict.REFUSED)


def evaluate(server_args, sglang_version: str) -> list[Finding]:
    """Every row against ``server_args``, in table order."""
    return [Finding(s, bool(s.applies(server_args, sglang_version)), s.written(server_args)) for s in SETTINGS]


# ----------------------------------------------------------------------------------------------- docs
def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """The full table (docs/settings.md)."""
    lines = ["| flag | applies when | verdict | why | test |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        test = f"`{s.test}`" if s.test else ("start-up refusal (`check_speculative`)"
                                            if s.raised_by == CHECK_SPECULATIVE else
                                            "start-up refusal" if s.verdict is Verdict.REFUSED else "")
        lines.append(f"| `{s.flag}` | {_cell(s.when)} | {s.verdict.label} | {_cell(s.why)} | {test} |")
    return "\n".join(lines)


def readme_table() -> str:
    """The short table (README.md): one row per flag, its verdicts with when each applies."""
    by_flag: dict[str, list[str]] = {}
    for s in SETTINGS:
        by_flag.setdefault(s.flag, []).append(f"{s.verdict.label} ({s.when})")
    lines = ["| flag | verdict (when) |", "|---|---|"]
    lines += [f"| `{flag}` | {_cell('; '.join(verdicts))} |" for flag, verdicts in by_flag.items()]
    return "\n".join(lines)


SETTINGS_DOC_HEAD = """# Which sglang settings kvcanary covers

Generated from `plugin/kvcanary/sglang/audit.py` by `python -m kvcanary.sglang.audit --markdown`; do not edit by
hand (`tests/adapters/test_audit.py` fails when this page and the code differ).

Every sglang 0.5.12 `launch_server` setting that moves KV or changes how slots map to tokens is either
**covered** (the test named exercises it with kvcanary installed), **refused** at start-up (kvcanary stops the
launch with an error naming the flag as written and what to change), or has **no KV effect** (considered: it
neither moves KV nor remaps slots). A setting with no test a CPU machine can run is refused, not called covered.
Rows whose "applies when" does not hold are silent. Check a command line before launching it with
`kvcanary check -- <launch_server arguments>`.
"""

SETTINGS_DOC_TAIL = """
Decided elsewhere, not by a flag: the KV pool class (MHA incl. paged, MLA, SWA are known; any other pool is refused
at install naming its class), forward modes (anything but EXTEND, DECODE, MIXED, IDLE and EAGLE's two is refused
naming the mode), prefill graph runners (an unknown one is refused after init), and on sglang 0.5.23
`--enable-unified-memory` (refused by `kvcanary.sglang.v0_5_23`). sglang 0.5.12 has no double-sparsity setting.
"""


def settings_doc() -> str:
    return SETTINGS_DOC_HEAD + "\n" + markdown_table() + "\n" + SETTINGS_DOC_TAIL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcanary.sglang.audit",
                                     description="Print the sglang settings audit as markdown.")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="docs/settings.md, whole")
    group.add_argument("--readme", action="store_true", help="the README's short table")
    args = parser.parse_args(argv)
    sys.stdout.write(settings_doc() if args.markdown else readme_table() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
