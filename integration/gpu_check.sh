#!/usr/bin/env bash
# kvcanary GPU check: one command, run from the repository root on a CUDA machine.
#
#   bash integration/gpu_check.sh
#
# Steps (each timed, logged, and kept going after a failure):
#   setup     install the carried wheels from .whl/ (apache-tvm-ffi, ninja) into /tmp/site, set the env
#   build     JIT-build the CPU and CUDA kernels (kvcanary.kernels.jit.build) and load both
#   gpu-tests pytest tests/gpu and the runtime's gpu-marked tests (CUDA graph capture + replay vs the CPU backend,
#             deferred writes on CUDA)
#   kernels   pytest tests/kernels -m "not slow" (differential CPU / ref / CUDA, out-of-range, ...)
#   memcheck  compute-sanitizer memcheck over the CUDA out-of-range tests + 2 differential chunks + 2 chunks of
#             the attribution tests (violation metadata, writer attribution) + 2 chunks of the fused check + the
#             token upload from pinned memory (not its busy-device test: under the sanitizer launches serialise, so
#             the device is never behind the host and the staging ring never has to wait) + the sweep-plan commit
#             (2 differential chunks, a grid-strided launch at the metadata block's bounds, SweepIndex on CUDA)
#             + the status mirror (the check launch writing pinned host memory in place) + the bound launches
#             (parameters prepared once at binding: the same launches as the exports, a captured graph of them)
#             + the deferred write (the previous forward's write run by the next check launch's gate opener)
#             (override the -k expression with GPU_CHECK_MEMCHECK_K)
#             (reported as UNAVAILABLE, not FAIL, when the sanitizer cannot run on this machine)
#   bench     benchmarks/bench_kernels.py (--quick when little time is left)
#   bench-manager  benchmarks/bench_manager.py (per-forward canary cost, decode with CUDA graphs)
#   bench-host  benchmarks/bench_host.py (host time of the manager's per-forward calls and of each export alone)
#   bench-attribution  benchmarks/bench_attribution.py (write / verify with and without writer attribution)
#   bench-forward-path  benchmarks/bench_forward_path.py (kvcanary host us per eager forward, sglang's call sequence)
#   bench-forward-path-cold  the same for two cases with the caches cold between forwards (--cold 64), as in the engine
# Output: $OUT/gpu_check.md (summary table, also printed last), $OUT/<step>.log, $OUT/bench.json;
# $OUT defaults to ./gpu_check_out. Exit status: 0 only if no step failed.
# Total wall time is capped by GPU_CHECK_BUDGET_S (default 480 s): each step's timeout is cut to what is left.
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2
OUT_DIR="${OUT:-$REPO/gpu_check_out}"
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/gpu_check.md"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
START_S=$(date +%s)
PY="${PYTHON:-python3}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"

export KVCANARY_CUDA_ARCH="${KVCANARY_CUDA_ARCH:-9.0a}"
export TVM_FFI_CUDA_ARCH_LIST="${TVM_FFI_CUDA_ARCH_LIST:-$KVCANARY_CUDA_ARCH}"
export KVCANARY_CACHE_DIR="${KVCANARY_CACHE_DIR:-/tmp/kvc-cache}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$SITE/bin:$CUDA_HOME/bin:$PATH"
export PYTHONPATH="$SITE:$REPO/plugin${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MAX_JOBS="${MAX_JOBS:-8}"

NAMES=()
STATUSES=()
DURATIONS=()
NOTES=()
FAILED=0

elapsed() { echo $(( $(date +%s) - START_S )); }

# record NAME STATUS SECONDS NOTE
record() {
  NAMES+=("$1"); STATUSES+=("$2"); DURATIONS+=("$3"); NOTES+=("$4")
  case "$2" in PASS|UNAVAILABLE) ;; *) FAILED=1 ;; esac
  printf '[gpu_check] %-10s %-11s %4ss  %s\n' "$1" "$2" "$3" "$4"
}

# step_timeout MAX: the timeout for the next step, cut to the remaining budget (0 = no time left)
step_timeout() {
  local left=$(( BUDGET_S - $(elapsed) - 10 ))
  if (( left < 15 )); then echo 0; elif (( left < $1 )); then echo "$left"; else echo "$1"; fi
}

# run_step NAME MAX_S COMMAND...: runs COMMAND with a timeout, output to $OUT_DIR/NAME.log.
# Sets STEP_RC and STEP_S; returns the command's status (124 on timeout).
run_step() {
  local name="$1" max="$2"; shift 2
  local t; t=$(step_timeout "$max")
  local log="$OUT_DIR/$name.log"
  STEP_S=0
  if [[ "$t" == 0 ]]; then
    echo "skipped: the ${BUDGET_S}s budget is used up" > "$log"
    STEP_RC=125
    return 125
  fi
  local t0; t0=$(date +%s)
  echo "\$ $* (timeout ${t}s)" > "$log"
  timeout --kill-after=15 "$t" "$@" >> "$log" 2>&1
  STEP_RC=$?
  STEP_S=$(( $(date +%s) - t0 ))
  return "$STEP_RC"
}

status_of() {  # status_of RC
  case "$1" in 0) echo PASS ;; 124|137) echo TIMEOUT ;; 125) echo SKIPPED ;; *) echo FAIL ;; esac
}

# pytest's one-line result ("12 passed, 3 skipped in 4.2s"), if any
pytest_result() {
  grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed).* in [0-9.]+s' "$1" | tail -n 1 |
    sed 's/=//g; s/^ *//; s/ *$//'
}

# ------------------------------------------------------------------------------------------------ env
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo no-git), $(git -C "$REPO" status --porcelain 2>/dev/null | wc -l) changed files)"
  echo "python: $($PY --version 2>&1)"
  echo "nvcc: $(command -v nvcc || echo missing) $(nvcc --version 2>/dev/null | tail -n 2 | head -n 1)"
  echo "g++: $(g++ --version 2>/dev/null | head -n 1)"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: nvidia-smi not found"
  fi
  echo "compute-sanitizer: $(command -v compute-sanitizer || ls "$CUDA_HOME"/bin/compute-sanitizer 2>/dev/null || echo missing)"
  env | grep -E '^(CUDA_HOME|KVCANARY_|TVM_FFI_|PYTHONPATH|MAX_JOBS)=' | sort
} > "$OUT_DIR/env.log" 2>&1

# ------------------------------------------------------------------------------------------------ setup
t0=$(date +%s)
setup_note=""
setup_rc=0
{
  shopt -s nullglob
  tvm_wheels=(.whl/apache_tvm_ffi-*.whl)
  other_wheels=()
  for w in .whl/*.whl; do
    [[ "$w" == .whl/apache_tvm_ffi-* ]] && continue
    dist="$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z' | tr '-' '_')"
    # Install a carried helper (ninja, pytest, ...) only when the machine lacks it: never shadow its own.
    if [[ "$dist" == ninja ]] && command -v ninja >/dev/null 2>&1; then continue; fi
    if [[ "$dist" != ninja ]] && "$PY" -c "import $dist" >/dev/null 2>&1; then continue; fi
    other_wheels+=("$w")
  done
  shopt -u nullglob
  wheels=()
  if (( ${#tvm_wheels[@]} > 0 )); then
    # Several versions may be carried: GPU_CHECK_TVM_FFI_VERSION picks one, else the newest.
    pick=""
    if [[ -n "${GPU_CHECK_TVM_FFI_VERSION:-}" ]]; then
      for w in "${tvm_wheels[@]}"; do
        [[ "$w" == .whl/apache_tvm_ffi-"$GPU_CHECK_TVM_FFI_VERSION"-* ]] && pick="$w"
      done
      [[ -z "$pick" ]] && { echo "no carried wheel for apache-tvm-ffi $GPU_CHECK_TVM_FFI_VERSION"; setup_rc=1; }
    else
      pick="$(printf '%s\n' "${tvm_wheels[@]}" | sort -V | tail -n 1)"
    fi
    [[ -n "$pick" ]] && wheels+=("$pick")
  fi
  wheels+=(${other_wheels[@]+"${other_wheels[@]}"})
  if (( ${#tvm_wheels[@]} > 0 )); then
    echo "installing carried wheels into $SITE: ${wheels[*]}"
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}" || setup_rc=$?
  elif "$PY" -c "import tvm_ffi" 2>/dev/null; then
    echo "no .whl/ wheels; using the installed apache-tvm-ffi"
  else
    echo "no .whl/ wheels and no apache-tvm-ffi: trying the network"
    timeout 180 "$PY" -m pip install -q --no-cache-dir --target "$SITE" "apache-tvm-ffi>=0.1.9,<0.2" ninja || setup_rc=$?
  fi
  if ! command -v ninja >/dev/null 2>&1; then
    echo "warning: no ninja on PATH (tvm-ffi needs it); carry the ninja wheel in .whl/"
  fi
  "$PY" - <<'EOF' || setup_rc=$?
import sys
import torch
import tvm_ffi
import kvcanary
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
print("tvm_ffi", getattr(tvm_ffi, "__version__", "?"), "from", tvm_ffi.__file__)
print("kvcanary", kvcanary.__version__, "from", kvcanary.__file__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
else:
    sys.exit("torch sees no CUDA device")
EOF
} > "$OUT_DIR/setup.log" 2>&1
setup_s=$(( $(date +%s) - t0 ))
setup_note="$(grep -E '^tvm_ffi |^device ' "$OUT_DIR/setup.log" | sed 's/ from .*//' | paste -sd ';' -)"
record setup "$(status_of $setup_rc)" "$setup_s" "${setup_note:-see setup.log}"

# ------------------------------------------------------------------------------------------------ build
run_step build 240 "$PY" - <<'EOF'
import time

from kvcanary import ops
from kvcanary.kernels import jit

for backend in ("cpu", "cuda"):
    t0 = time.perf_counter()
    info = jit.build(backend)
    print(f"build {backend}: arch={info.arch} {time.perf_counter() - t0:.1f}s cached={info.cached} -> {info.library}")
for backend in ("cpu", "cuda"):
    module = ops.load_module(backend)
    name = str(module.canary_backend_name())
    assert name == backend, f"module for {backend} reports {name!r}"
    print(f"load {backend}: ok ({name})")
EOF
build_note="$(grep -E '^build ' "$OUT_DIR/build.log" | sed -E 's/^build ([a-z]+): arch=([^ ]+) ([0-9.]+s) cached=([A-Za-z]+).*/\1 \3 (cached=\4)/' | paste -sd ',' -)"
record build "$(status_of $STEP_RC)" "$STEP_S" "${build_note:-see build.log}"

# ------------------------------------------------------------------------------------------------ pytest
run_step gpu-tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu tests/runtime -m gpu
gpu_result="$(pytest_result "$OUT_DIR/gpu-tests.log")"
if [[ "$STEP_RC" == 0 ]] && ! grep -qE '[0-9]+ passed' <<<"$gpu_result"; then
  record gpu-tests FAIL "$STEP_S" "no GPU test ran: ${gpu_result:-no pytest summary}"
else
  record gpu-tests "$(status_of $STEP_RC)" "$STEP_S" "$gpu_result"
fi

run_step kernels 180 "$PY" -m pytest -q -rs -p no:cacheprovider tests/kernels -m "not slow"
record kernels "$(status_of $STEP_RC)" "$STEP_S" "$(pytest_result "$OUT_DIR/kernels.log")"

# ------------------------------------------------------------------------------------------------ memcheck
SANITIZER=""
MEMCHECK_K="${GPU_CHECK_MEMCHECK_K:-cuda and (out_of_range or 0-cuda or 1-cuda or refuses_a_staging or commit_past_the_block_cap or index_plans_equal_the_cpu_index or status_mirror or bound_launches or bound_check_equals or bound_write_equals or bound_check_writes or token_mail or bound_append or deferred_write)}"
for cand in "$(command -v compute-sanitizer 2>/dev/null)" "$CUDA_HOME/bin/compute-sanitizer" \
            "$CUDA_HOME/compute-sanitizer/compute-sanitizer"; do
  if [[ -n "$cand" && -x "$cand" ]]; then SANITIZER="$cand"; break; fi
done
MEMCHECK_TESTS=()
for f in tests/kernels/test_differential.py tests/kernels/test_out_of_range.py tests/kernels/test_kernel_attribution.py \
         tests/kernels/test_check.py tests/kernels/test_token_update.py tests/kernels/test_sweep_plan_update.py \
         tests/kernels/test_bound_launch.py; do
  [[ -f "$f" ]] && MEMCHECK_TESTS+=("$f")
done
if [[ -z "$SANITIZER" ]]; then
  echo "compute-sanitizer not found (PATH, $CUDA_HOME/bin)" > "$OUT_DIR/memcheck.log"
  record memcheck UNAVAILABLE 0 "memcheck: unavailable (compute-sanitizer not found)"
elif (( ${#MEMCHECK_TESTS[@]} == 0 )); then
  echo "no differential/out-of-range test files" > "$OUT_DIR/memcheck.log"
  record memcheck FAIL 0 "test files missing"
else
  # Every CUDA out-of-range test and 2 of the 10 differential chunks per kernel (400 random launches):
  # memcheck slows every launch, and the full suite already ran unsanitized in the kernels step.
  # No caching allocator under memcheck: each tensor is its own cudaMalloc, so an overrun is caught
  # at the tensor's edge instead of landing silently inside a pooled block.
  # (300 s: the selection's 45 tests took ~225 s under the sanitizer on the H200 in 2026-12; at 150 s the step timed
  # out with 30 of them done)
  run_step memcheck 300 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool memcheck --error-exitcode 1 --target-processes all --print-limit 50 \
    "$PY" -m pytest -q -rs -p no:cacheprovider "${MEMCHECK_TESTS[@]}" -k "$MEMCHECK_K"
  mlog="$OUT_DIR/memcheck.log"
  unavailable="$(grep -m1 -iE 'device not supported|not supported on this (platform|device)|unable to find injection library|failed to (initialize|load) (the )?(injection|sanitizer)|CUDA driver version is insufficient|no CUDA-capable device|error: cuda initialization|Target application .* is not supported' "$mlog" | sed 's/^=* *//' | cut -c1-120)"
  summary="$(grep -m1 -E 'ERROR SUMMARY' "$mlog" | sed 's/^=* *//')"
  result="$(pytest_result "$mlog")"
  if [[ "$STEP_RC" == 0 ]] && grep -qE '[0-9]+ passed' <<<"$result"; then
    record memcheck PASS "$STEP_S" "${summary:-no sanitizer summary}; $result"
  elif [[ -n "$unavailable" ]]; then
    record memcheck UNAVAILABLE "$STEP_S" "memcheck: unavailable ($unavailable)"
  elif [[ "$STEP_RC" == 0 ]]; then
    record memcheck UNAVAILABLE "$STEP_S" "memcheck: unavailable (no CUDA test ran under the sanitizer: ${result:-no pytest summary})"
  else
    record memcheck "$(status_of "$STEP_RC")" "$STEP_S" "${summary:-no sanitizer summary}; ${result:-no pytest summary}"
  fi
fi

# ------------------------------------------------------------------------------------------------ bench
bench_args=(--json "$OUT_DIR/bench.json")
if (( BUDGET_S - $(elapsed) < 170 )); then bench_args+=(--quick); fi
run_step bench 200 "$PY" benchmarks/bench_kernels.py "${bench_args[@]}"
bench_note="$(grep -m1 -E '^correctness checks:' "$OUT_DIR/bench.log")"
[[ " ${bench_args[*]} " == *" --quick "* ]] && bench_note="quick; $bench_note"
record bench "$(status_of $STEP_RC)" "$STEP_S" "${bench_note:-see bench.log}"

# ------------------------------------------------------------------------------------------------ bench-manager
run_step bench-manager 150 "$PY" benchmarks/bench_manager.py --json "$OUT_DIR/bench_manager.json"
record bench-manager "$(status_of $STEP_RC)" "$STEP_S" "decode 1/64/256 x 4096 with graphs; see the table below"

# ------------------------------------------------------------------------------------------------ bench-host
run_step bench-host 90 "$PY" benchmarks/bench_host.py --iters 500
record bench-host "$(status_of $STEP_RC)" "$STEP_S" "host us per manager call and per export; see the table below"

# ------------------------------------------------------------------------------------------------ bench-attribution
attr_args=(--json "$OUT_DIR/bench_attribution.json")
if (( BUDGET_S - $(elapsed) < 60 )); then attr_args+=(--quick); fi
run_step bench-attribution 90 "$PY" benchmarks/bench_attribution.py "${attr_args[@]}"
record bench-attribution "$(status_of $STEP_RC)" "$STEP_S" "seed vs attributed write/verify; see the table below"

# ------------------------------------------------------------------------------------------------ bench-forward-path
run_step bench-forward-path 120 "$PY" benchmarks/bench_forward_path.py --device cuda --forwards 30 --rounds 5 --stat min
record bench-forward-path "$(status_of $STEP_RC)" "$STEP_S" "host us per eager forward, engine call sequence; see below"

# ------------------------------------------------------------------------------------------------ bench-forward-path-cold
# The same call sequence with 64 MiB written between forwards: kvcanary's code and data run from cold caches, as in
# the engine, where sglang's own work between two batches evicts them (benchmarks/README.md, --cold).
run_step bench-forward-path-cold 90 "$PY" benchmarks/bench_forward_path.py --device cuda --forwards 30 --rounds 5 \
  --stat min --cold 64 --cases "decode bs64 PARTIAL + tokens,decode bs64 PARTIAL + tokens + sweep 10 (tree changing)"
record bench-forward-path-cold "$(status_of $STEP_RC)" "$STEP_S" "the same, caches cold between forwards; see below"

# ------------------------------------------------------------------------------------------------ summary
{
  echo "## kvcanary GPU check"
  echo
  grep -E '^(gpu|python|nvcc):' "$OUT_DIR/env.log" | sed 's/^/- /'
  echo "- total: $(elapsed) s (budget ${BUDGET_S} s); logs: $OUT_DIR/<step>.log"
  echo
  echo "| step | status | seconds | note |"
  echo "|---|---|---|---|"
  for i in "${!NAMES[@]}"; do
    note="${NOTES[$i]//|//}"
    echo "| ${NAMES[$i]} | ${STATUSES[$i]} | ${DURATIONS[$i]} | ${note} |"
  done
  echo
  if [[ -f "$OUT_DIR/bench.json" ]]; then
    "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("markdown", ""))' "$OUT_DIR/bench.json" 2>/dev/null
  fi
  sed -n '/^### canary per-forward cost/,$p' "$OUT_DIR/bench-manager.log" 2>/dev/null
  sed -n '/^### kvcanary host time per call/,$p' "$OUT_DIR/bench-host.log" 2>/dev/null
  sed -n '/^kvcanary attribution cost/,$p' "$OUT_DIR/bench-attribution.log" 2>/dev/null
  sed -n '/^### kvcanary host µs per eager forward/,$p' "$OUT_DIR/bench-forward-path.log" 2>/dev/null
  sed -n '/^### kvcanary host µs per eager forward/,$p' "$OUT_DIR/bench-forward-path-cold.log" 2>/dev/null
} > "$SUMMARY"

# Show the end of each failing step's log, then the table (last, so it survives output truncation).
for i in "${!NAMES[@]}"; do
  case "${STATUSES[$i]}" in
    PASS|UNAVAILABLE) ;;
    *) echo "----- tail of ${NAMES[$i]}.log -----"; tail -n 40 "$OUT_DIR/${NAMES[$i]}.log" 2>/dev/null ;;
  esac
done
echo
cat "$SUMMARY"
if (( FAILED )); then
  echo "gpu_check: FAILED"
  exit 1
fi
echo "gpu_check: all steps passed"
exit 0
