"""``kvcanary doctor``: build every kernel backend available here and self-test each one.

A self-test writes a small chain (three requests, a prefill launch and a decode launch, PARTIAL real-KV
fingerprints from one :class:`~kvcanary.kernels.real_kv.RealKvSource`), verifies it clean, then corrupts it two
ways and checks that verify reports exactly the expected slots and reason bits:

* a stored token changed in the canary buffer → ``VERIFY_TOKEN`` at that slot and ``VERIFY_CHAIN_HASH``
  at its successor (whose expected prev_hash is recomputed from the corrupted record);
* a byte of the slot's real KV flipped → ``VERIFY_REAL_KV_HASH`` at that slot only.

Every launch must also advance ``kernel_run_counter`` by one. The functions here return dataclasses;
printing and exit codes live in :mod:`kvcanary.cli.main`.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcanary.kernels import jit, layout
from kvcanary.kernels.hash_ref import mix3 as _mix3
from kvcanary.kernels.hash_ref import splitmix64 as _splitmix64
from kvcanary.kernels.hash_ref import to_i64 as _signed
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.runtime import host_ext
from kvcanary.settings import ConfigError

logger = logging.getLogger(__name__)


# Self-test shape: three requests of distinct lengths over distinct, non-padding slots.
SELFTEST_NUM_SLOTS = 32
SELFTEST_KV_BYTES_PER_TOKEN = 64
SELFTEST_REQUEST_LENS = (3, 5, 2)
SELFTEST_RING_CAPACITY = 16
SELFTEST_KERNEL_KIND = 7
SELFTEST_SEED = 1234


# --------------------------------------------------------------------------------------------------
# results


@dataclass
class CheckResult:
    """One named assertion of the self-test."""

    name: str
    passed: bool
    detail: str = ""


@dataclass
class SelfTestResult:
    """Outcome of :func:`run_selftest` on one device."""

    backend: str
    device: str
    checks: list[CheckResult] = field(default_factory=list)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def detail(self) -> str:
        if self.error is not None:
            return f"error: {self.error}"
        failed = [c for c in self.checks if not c.passed]
        if failed:
            return "; ".join(f"{c.name}: {c.detail}" for c in failed)
        return f"{len(self.checks)} checks ok (clean chain, token corruption, KV byte flip, run counters)"


@dataclass
class BackendReport:
    """One row of the doctor table: how a backend was built and how its self-test went."""

    backend: str
    arch: str
    compile_only: bool = False
    build_seconds: float | None = None
    cached: bool = False
    library: Path | None = None
    build_error: str | None = None
    refused: str | None = None  # a bad KVCANARY_* value (the variable named) stopped this backend before its build
    selftest: SelfTestResult | None = None

    @property
    def label(self) -> str:
        return f"{self.backend} (compile only)" if self.compile_only else self.backend

    @property
    def passed(self) -> bool:
        if self.build_error is not None or self.refused is not None:
            return False
        if self.compile_only:
            return True
        return self.selftest is not None and self.selftest.passed

    @property
    def build_column(self) -> str:
        if self.refused is not None:
            return "refused"
        if self.build_error is not None:
            return "failed"
        if self.cached:
            return "cached"
        if self.build_seconds is None:
            return "-"
        return f"{self.build_seconds:.1f} s"

    @property
    def status(self) -> str:
        if self.build_error is None and self.refused is None and self.compile_only:
            return "n/a"
        return "PASS" if self.passed else "FAIL"

    @property
    def detail(self) -> str:
        if self.refused is not None:
            return self.refused
        if self.build_error is not None:
            return f"build failed: {self.build_error}"
        if self.compile_only:
            return f"compiled only (no CUDA device here); {self.library}"
        if self.selftest is None:
            return "self-test not run"
        return self.selftest.detail


@dataclass
class DoctorReport:
    """Everything ``kvcanary doctor`` found."""

    rows: list[BackendReport]
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)


# --------------------------------------------------------------------------------------------------
# hashes (SPEC §2): the plain-Python model in kvcanary.kernels.hash_ref, independent of the compiled kernels


def _fold(data: bytes) -> int:
    acc = 0
    for i in range(0, len(data), 16):
        acc = _splitmix64(acc ^ int.from_bytes(data[i : i + 8], "little"))
        acc = _splitmix64(acc ^ int.from_bytes(data[i + 8 : i + 16], "little"))
    return _splitmix64(0 ^ acc)


# --------------------------------------------------------------------------------------------------
# self-test


@dataclass
class _Chain:
    """Host-side description of the chain the self-test writes."""

    slots: list[list[int]]  # per request, slot of each position
    tokens: list[list[int]]


@dataclass
class _Sinks:
    ring: torch.Tensor
    index: torch.Tensor
    slot_runs: torch.Tensor
    kernel_runs: torch.Tensor


def _i64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _i32(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32, device=device)


def _new_sinks(device: torch.device) -> _Sinks:
    return _Sinks(
        ring=torch.zeros((SELFTEST_RING_CAPACITY, layout.VIOLATION_FIELDS), dtype=torch.int64, device=device),
        index=torch.zeros(1, dtype=torch.int32, device=device),
        slot_runs=torch.zeros(1, dtype=torch.int64, device=device),
        kernel_runs=torch.zeros(1, dtype=torch.int64, device=device),
    )


def _violations(sinks: _Sinks) -> list[list[int]]:
    count = int(sinks.index.cpu().item())
    rows = sinks.ring.cpu()[: min(count, SELFTEST_RING_CAPACITY)].tolist()
    return [[int(v) for v in row] for row in rows]


def _make_chain(num_slots: int) -> _Chain:
    gen = torch.Generator().manual_seed(SELFTEST_SEED)
    total = sum(SELFTEST_REQUEST_LENS)
    # Distinct slots, never the padding slot 0.
    pool = (torch.randperm(num_slots - 1, generator=gen) + 1)[:total].tolist()
    tokens = torch.randint(0, 150_000, (total,), generator=gen).tolist()
    slots, toks, start = [], [], 0
    for n in SELFTEST_REQUEST_LENS:
        slots.append([int(s) for s in pool[start : start + n]])
        toks.append([int(t) for t in tokens[start : start + n]])
        start += n
    return _Chain(slots, toks)


def _write(
    canary_buf: torch.Tensor,
    sources: list[RealKvSource],
    sinks: _Sinks,
    requests: list[tuple[int, list[tuple[int, int, int]]]],
) -> None:
    """One write launch. ``requests``: (seed slot, [(slot, token, position), ...]) per request."""
    from kvcanary.kernels.write import canary_write_step

    device = canary_buf.device
    offsets, seeds, slots, tokens, positions = [0], [], [], [], []
    for seed, entries in requests:
        seeds.append(seed)
        for slot, token, position in entries:
            slots.append(slot)
            tokens.append(token)
            positions.append(position)
        offsets.append(len(slots))
    canary_write_step(
        canary_buf=canary_buf,
        write_offsets=_i64(offsets, device),
        write_seed_slot_indices=_i64(seeds, device),
        write_num_valid_reqs=_i32(len(requests), device),
        input_ids=_i64(tokens, device),
        positions=_i64(positions, device),
        out_cache_loc=_i64(slots, device),
        kernel_kind=SELFTEST_KERNEL_KIND,
        enable_write_input_assert=True,
        expected_input_tokens=_i64(tokens, device),
        expected_input_positions=_i64(positions, device),
        violation_ring=sinks.ring,
        violation_write_index=sinks.index,
        slot_run_counter=sinks.slot_runs,
        kernel_run_counter=sinks.kernel_runs,
        enable_chain_position_assert=_i32(1, device),
        real_kv_sources=sources,
        real_kv_hash_mode=layout.REAL_KV_HASH_MODE_PARTIAL,
    )


def _verify(canary_buf: torch.Tensor, sources: list[RealKvSource], sinks: _Sinks, chain: _Chain) -> None:
    """One verify launch over every position of every request, tokens checked."""
    from kvcanary.kernels.verify import canary_verify_step

    device = canary_buf.device
    slots, tokens, positions, prevs = [], [], [], []
    for req_slots, req_tokens in zip(chain.slots, chain.tokens, strict=True):
        for p, (slot, token) in enumerate(zip(req_slots, req_tokens, strict=True)):
            slots.append(slot)
            tokens.append(token)
            positions.append(p)
            prevs.append(layout.CHAIN_HEAD_SLOT if p == 0 else req_slots[p - 1])
    canary_verify_step(
        canary_buf=canary_buf,
        verify_slot_indices=_i64(slots, device),
        verify_expected_tokens=_i64(tokens, device),
        verify_expected_positions=_i64(positions, device),
        verify_prev_slot_indices=_i64(prevs, device),
        verify_num_valid=_i32(len(slots), device),
        verify_enable=_i32(1, device),
        kernel_kind=SELFTEST_KERNEL_KIND,
        violation_ring=sinks.ring,
        violation_write_index=sinks.index,
        slot_run_counter=sinks.slot_runs,
        kernel_run_counter=sinks.kernel_runs,
        real_kv_sources=sources,
        real_kv_hash_mode=layout.REAL_KV_HASH_MODE_PARTIAL,
        check_tokens=True,
    )


def _corrupt_token(canary_buf: torch.Tensor, slot: int) -> None:
    """Change the token stored in ``slot``'s record (in place)."""
    records = canary_buf.view(torch.int64)
    records[slot, layout.RECORD_FIELD_TOKEN] += 1


def _flip_kv_byte(kv: torch.Tensor, slot: int) -> None:
    """Flip one byte of ``slot``'s real KV inside the PARTIAL window (first 16 bytes), in place."""
    kv[slot, 5] ^= 0xFF


def _expect_rows(name: str, rows: list[list[int]], expected: dict[int, int]) -> CheckResult:
    """Exactly one violation row per slot in ``expected`` with exactly those reason bits."""
    got = {row[layout.VIOLATION_COL_SLOT]: row[layout.VIOLATION_COL_FAIL_REASON_BITS] for row in rows}
    if len(rows) == len(expected) and got == expected:
        return CheckResult(name, True, f"{len(rows)} violation(s) as expected")

    def fmt(d: dict[int, int]) -> str:
        return ", ".join(f"slot {s}: {'|'.join(layout.reason_names(b)) or '0'}" for s, b in sorted(d.items())) or "none"

    return CheckResult(name, False, f"expected {{{fmt(expected)}}}, got {len(rows)} row(s) {{{fmt(got)}}}")


def _expect_equal(name: str, got: object, want: object) -> CheckResult:
    if got == want:
        return CheckResult(name, True, f"{got}")
    return CheckResult(name, False, f"expected {want}, got {got}")


def run_selftest(device: str | torch.device = "cpu") -> SelfTestResult:
    """Write, verify and corrupt a small chain on ``device``; never raises (errors land in the result)."""
    dev = torch.device(device)
    result = SelfTestResult(backend=dev.type, device=str(dev))
    try:
        _run_selftest(dev, result.checks)
    except Exception as exc:  # noqa: BLE001 - the doctor reports every failure as a row
        logger.debug("kvcanary doctor: self-test on %s raised", dev, exc_info=True)
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return result


def _run_selftest(dev: torch.device, checks: list[CheckResult]) -> None:
    add: Callable[[CheckResult], None] = checks.append
    num_slots = SELFTEST_NUM_SLOTS
    gen = torch.Generator().manual_seed(SELFTEST_SEED + 1)
    kv_host = torch.randint(0, 256, (num_slots, SELFTEST_KV_BYTES_PER_TOKEN), dtype=torch.uint8, generator=gen)
    kv = kv_host.to(dev)
    source = RealKvSource(kv, page_size=1, num_bytes_per_token=SELFTEST_KV_BYTES_PER_TOKEN, read_bytes=64)
    canary_buf = torch.zeros((num_slots, layout.RECORD_BYTES), dtype=torch.uint8, device=dev)
    chain = _make_chain(num_slots)
    num_entries = sum(SELFTEST_REQUEST_LENS)

    # 1. Write: a prefill launch of all but the last token of each request, then a decode launch whose
    #    seeds are the previous positions' slots (exercises the seed path and the chain-position assert).
    write_sinks = _new_sinks(dev)
    prefill = [
        (layout.CHAIN_HEAD_SLOT, [(s, t, p) for p, (s, t) in enumerate(zip(slots[:-1], toks[:-1], strict=True))])
        for slots, toks in zip(chain.slots, chain.tokens, strict=True)
    ]
    decode = [
        (slots[-2], [(slots[-1], toks[-1], len(slots) - 1)])
        for slots, toks in zip(chain.slots, chain.tokens, strict=True)
    ]
    _write(canary_buf, [source], write_sinks, prefill)
    _write(canary_buf, [source], write_sinks, decode)
    add(_expect_rows("write: no violations", _violations(write_sinks), {}))
    add(_expect_equal("write: kernel_run_counter", int(write_sinks.kernel_runs.cpu().item()), 2))
    add(_expect_equal("write: slot_run_counter", int(write_sinks.slot_runs.cpu().item()), num_entries))

    # 2. The records match SPEC §2 computed here in Python (token, position, chain, PARTIAL fingerprint).
    records = canary_buf.cpu().view(torch.int64).tolist()
    mismatches = []
    for req_slots, req_tokens in zip(chain.slots, chain.tokens, strict=True):
        running = _splitmix64(layout.CHAIN_ANCHOR)
        for p, (slot, token) in enumerate(zip(req_slots, req_tokens, strict=True)):
            want = [token, p, _signed(running), _signed(_fold(bytes(kv_host[slot, :16].tolist())))]
            if records[slot][: layout.RECORD_FIELDS] != want:
                mismatches.append(slot)
            running = _mix3(running, token, p)
    add(
        CheckResult("write: records match the reference hashes", not mismatches, f"mismatching slots {mismatches}")
        if mismatches
        else CheckResult("write: records match the reference hashes", True, f"{num_entries} records")
    )

    # 3. Verify the clean chain.
    sinks = _new_sinks(dev)
    _verify(canary_buf, [source], sinks, chain)
    add(_expect_rows("verify clean: no violations", _violations(sinks), {}))
    add(_expect_equal("verify clean: kernel_run_counter", int(sinks.kernel_runs.cpu().item()), 1))
    add(_expect_equal("verify clean: slot_run_counter", int(sinks.slot_runs.cpu().item()), num_entries))

    # 4. Corrupt the stored token of a middle record of the longest request.
    victim_req = max(range(len(chain.slots)), key=lambda r: len(chain.slots[r]))
    victim, successor = chain.slots[victim_req][1], chain.slots[victim_req][2]
    bad_buf = canary_buf.clone()
    _corrupt_token(bad_buf, victim)
    sinks = _new_sinks(dev)
    _verify(bad_buf, [source], sinks, chain)
    add(
        _expect_rows(
            "verify detects a changed token",
            _violations(sinks),
            {victim: layout.REASON_VERIFY_TOKEN, successor: layout.REASON_VERIFY_CHAIN_HASH},
        )
    )
    add(_expect_equal("verify (token): kernel_run_counter", int(sinks.kernel_runs.cpu().item()), 1))
    unchanged = bool(torch.equal(bad_buf.cpu(), _corrupted_copy(canary_buf, victim)))
    add(_expect_equal("verify left canary_buf unchanged", unchanged, True))

    # 5. Flip a byte of a slot's real KV.
    kv_victim = chain.slots[0][0]
    bad_kv = kv.clone()
    _flip_kv_byte(bad_kv, kv_victim)
    bad_source = RealKvSource(bad_kv, page_size=1, num_bytes_per_token=SELFTEST_KV_BYTES_PER_TOKEN, read_bytes=64)
    sinks = _new_sinks(dev)
    _verify(canary_buf, [bad_source], sinks, chain)
    add(
        _expect_rows(
            "verify detects a flipped KV byte",
            _violations(sinks),
            {kv_victim: layout.REASON_VERIFY_REAL_KV_HASH},
        )
    )
    add(_expect_equal("verify (KV): kernel_run_counter", int(sinks.kernel_runs.cpu().item()), 1))


def _corrupted_copy(canary_buf: torch.Tensor, slot: int) -> torch.Tensor:
    """What the token-corrupted buffer must still hold after a (read-only) verify."""
    copy = canary_buf.cpu().clone()
    copy.view(torch.int64)[slot, layout.RECORD_FIELD_TOKEN] += 1
    return copy


# --------------------------------------------------------------------------------------------------
# builds


def find_nvcc() -> str | None:
    """nvcc on PATH, else under ``$CUDA_HOME`` / ``$CUDA_PATH`` / ``/usr/local/cuda``."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def cuda_device_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver means "no device" here
        return False


def display_arch(backend: str, arch: str) -> str:
    if backend == "cpu":
        return platform.machine() or "host"
    return "sm_" + arch.replace(".", "")


def check_environment() -> None:
    """The build variables every backend shares (``KVCANARY_CACHE_DIR``, ``KVCANARY_SANITIZE``): a bad value is a
    ``ConfigError`` naming it, raised before any row (each row would fail the same way). ``KVCANARY_CUDA_ARCH``
    concerns the CUDA row alone, which reports it (the CPU row still runs)."""
    jit.cache_root()
    jit.sanitizer()


def check_backend(
    backend: str, *, rebuild: bool = False, compile_only: bool = False, progress: Callable[[str], None] | None = None
) -> BackendReport:
    """Build ``backend`` (timed; ``rebuild`` forces it) and, unless ``compile_only``, self-test it.

    ``progress`` gets one line before a build that will compile (the cache misses, or ``rebuild``) and one with its
    time after: a cold build takes tens of seconds, and a silent command looks hung.
    """
    try:
        arch = jit.cuda_arch() if backend == "cuda" else "host"
    except ConfigError as exc:  # a bad KVCANARY_CUDA_ARCH: this row is refused, naming it; other rows still run
        return BackendReport(backend=backend, arch="-", compile_only=compile_only, refused=str(exc))
    report = BackendReport(backend=backend, arch=display_arch(backend, arch), compile_only=compile_only)
    try:
        build_arch = arch if backend == "cuda" else None
        will_build = rebuild or not jit.is_built(backend, arch=build_arch)
        if will_build and progress is not None:
            why = "--rebuild" if rebuild else "first run"
            progress(f"kvcanary doctor: building the {backend} kernels ({why}, "
                     f"~{jit.TYPICAL_BUILD_SECONDS[backend]} s) ...")
        info = jit.build(backend, arch=build_arch, force=rebuild)
        if will_build and progress is not None:
            progress(f"kvcanary doctor: built the {backend} kernels in {info.seconds:.1f} s")
    except Exception as exc:  # noqa: BLE001 - a failed build is a FAIL row, with the compiler's first line
        logger.debug("kvcanary doctor: %s build raised", backend, exc_info=True)
        report.build_error = _first_line(exc)
        return report
    report.build_seconds = info.seconds
    report.cached = info.cached
    report.library = info.library
    logger.info("kvcanary doctor: %s library %s (cached=%s)", backend, info.library, info.cached)
    if not compile_only:
        report.selftest = run_selftest("cuda" if backend == "cuda" else "cpu")
    return report


def _cuda_arch_error() -> str | None:
    try:
        jit.cuda_arch()
    except ConfigError as exc:
        return str(exc)
    return None


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip() if lines else ''}"


def run_doctor(
    *, rebuild: bool = False, compile_cuda: bool = False, progress: Callable[[str], None] | None = None
) -> DoctorReport:
    """Build and self-test every backend available here (CPU always; CUDA with a device).

    Without a CUDA device the CUDA build is skipped, unless ``compile_cuda`` asks for a compile-only
    build (needs nvcc); a bad ``KVCANARY_CUDA_ARCH`` is still a refused CUDA row, as the plugin would refuse
    to start with it. ``progress``: see :func:`check_backend`.
    """
    report = DoctorReport(rows=[check_backend("cpu", rebuild=rebuild, progress=progress)])
    if cuda_device_available():
        report.rows.append(check_backend("cuda", rebuild=rebuild, progress=progress))
    elif compile_cuda:
        report.rows.append(check_backend("cuda", rebuild=rebuild, compile_only=True, progress=progress))
    elif (arch_error := _cuda_arch_error()) is not None:
        report.rows.append(BackendReport(backend="cuda", arch="-", refused=arch_error))
    else:
        nvcc = find_nvcc()
        if nvcc:
            report.notes.append(
                f"cuda: skipped (no CUDA device; nvcc found at {nvcc}: --compile-cuda compile-checks the CUDA build)"
            )
        else:
            report.notes.append("cuda: skipped (no CUDA device, no nvcc)")
    report.notes.append(host_extension_note())
    return report


def host_extension_note() -> str:
    """The host extension's line (kvcanary.runtime.host_ext, built here if it is not in the cache): where it is, or
    why it is not available (not a failure: the token check's decode batches then take the Python path)."""
    try:
        library = host_ext.build()
        host_ext.load()
    except host_ext.HostExtError as exc:
        return (f"host extension: not available ({exc}); the token check's decode batches take the Python path "
                "(the same checks, more host time per forward)")
    return f"host extension: ok ({library})"

