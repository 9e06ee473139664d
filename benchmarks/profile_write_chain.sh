#!/usr/bin/env bash
# Issue 15, write 1 x 8192 NONE: time the write kernel's chain walks and profile the shipped one (GPU box).
#
#   bash benchmarks/profile_write_chain.sh            # writes to $OUT (default /tmp/write-chain), < 4 min on an H200
#
# 1. builds the CUDA module (jit.build) and, in parallel, benchmarks/bench_chain_variants.py's modules; then
#    times the chain-only variants and the real write kernel once per chain walk (shuffle / staged8 / staged32),
#    each checked bit-exact against the Python model;
# 2. times the shipped build (CUDA events: median of one launch, and 20 back to back);
# 3. ncu (--clock-control none, --set full) on one launch of the shipped write kernel: the warp-state and
#    scheduler sections and the per-instruction stall samples, summarised (top instructions, per opcode).
# Files in $OUT (5): summary.txt (everything printed), write.ncu-rep, ncu_details.csv, ncu_source_sass.csv,
# write_kernel.sass.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/write-chain}"
mkdir -p "$OUT"
exec > >(tee "$OUT/summary.txt") 2>&1

if ls .whl/*.whl > /dev/null 2>&1; then
  mkdir -p /tmp/site && pip install -q --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD/plugin${PYTHONPATH:+:$PYTHONPATH}"
export KVCANARY_CACHE_DIR="${KVCANARY_CACHE_DIR:-/tmp/kvc-cache}" KVCANARY_CUDA_ARCH="${KVCANARY_CUDA_ARCH:-9.0a}"
export TVM_FFI_CUDA_ARCH_LIST="${TVM_FFI_CUDA_ARCH_LIST:-9.0a}" CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="/tmp/site/bin:$CUDA_HOME/bin:$PATH" MAX_JOBS="${MAX_JOBS:-16}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader || true
git log -1 --format='HEAD %h %s' || true

start=$(date +%s)
# All builds first, in parallel (no timing runs while nvcc loads the CPU).
python3 -c "from kvcanary.kernels import jit; print(jit.build('cuda'))" > "$OUT/.build.log" 2>&1 &
build_pid=$!
python3 benchmarks/bench_chain_variants.py --build-only || { echo "FAIL: bench module build"; exit 1; }
wait "$build_pid"
build_rc=$?
cat "$OUT/.build.log"; rm -f "$OUT/.build.log"
[ "$build_rc" -eq 0 ] || { echo "FAIL: jit.build('cuda') rc=$build_rc"; exit 1; }
echo "(builds: $(( $(date +%s) - start )) s)"
echo "== chain variants and kernel walks (1 x 8192 NONE)"
python3 benchmarks/bench_chain_variants.py --entries 8192 --reps 30
bench_rc=$?
echo "== shipped build, and the slot attribution's cost (staged8 only)"
python3 benchmarks/bench_chain_variants.py --entries 8192 --reps 30 --walks staged8 --attribution --shipped \
  2>&1 | grep -E "^\| (shipped|staged8|write kernel)|Error|assert|FAIL"
echo "(elapsed $(( $(date +%s) - start )) s)"

so=$(ls "$KVCANARY_CACHE_DIR"/*/cuda-*/kvcanary_ops.so 2>/dev/null | head -1)
if [ -n "$so" ] && command -v cuobjdump > /dev/null; then
  cuobjdump -sass -fun '_ZN8kvcanary19canary_write_kernelENS_11WriteParamsE' "$so" > "$OUT/write_kernel.sass" 2>&1
  echo "== SASS of the shipped write kernel: $(grep -c '/\*[0-9a-f]\{4,\}\*/' "$OUT/write_kernel.sass") instructions," \
       "LDS.128 $(grep -c 'LDS.128' "$OUT/write_kernel.sass"), SHFL.IDX $(grep -c 'SHFL.IDX' "$OUT/write_kernel.sass")"
fi

NCU=$(command -v ncu || echo "$CUDA_HOME/bin/ncu")
if [ ! -x "$NCU" ]; then
  echo "ncu not found: no profile"; exit "$bench_rc"
fi
echo "== ncu: one launch of the shipped write kernel (after 3), --set full"
timeout 150 "$NCU" --clock-control none --set full --import-source no -k regex:canary_write_kernel -s 3 -c 1 \
  -f -o "$OUT/write" python3 benchmarks/bench_chain_variants.py --profile-launches 5 > "$OUT/.ncu.log" 2>&1
ncu_rc=$?
tail -5 "$OUT/.ncu.log"; rm -f "$OUT/.ncu.log"
if [ "$ncu_rc" -eq 0 ] && [ -f "$OUT/write.ncu-rep" ]; then
  "$NCU" -i "$OUT/write.ncu-rep" --page details --csv > "$OUT/ncu_details.csv"
  "$NCU" -i "$OUT/write.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_source_sass.csv"
  python3 - "$OUT/ncu_details.csv" "$OUT/ncu_source_sass.csv" <<'EOF'
"""Print the warp-state/scheduler metrics and where the stall samples sit (per instruction and per opcode)."""
import collections
import csv
import sys


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


with open(sys.argv[1], newline="") as f:
    rows = list(csv.DictReader(f))
wanted = ("warpstate", "scheduler", "launch", "speedoflight", "instruction")
for r in rows:
    section = r.get("Section Name", "")
    if any(w in section.replace(" ", "").lower() for w in wanted):
        print(f"  {section[:28]:28s} {r.get('Metric Name', '')[:52]:52s} {r.get('Metric Value', '')} {r.get('Metric Unit', '')}")
with open(sys.argv[2], newline="") as f:
    lines = [line for line in f if line.strip()]
start = next((i for i, line in enumerate(lines) if "Source" in line and "Address" in line), 0)
src = list(csv.DictReader(lines[start:]))
if not src:
    sys.exit("no source rows")
cols = [c for c in src[0] if c and ("Sampl" in c or "stall" in c.lower())]
totals = {c: sum(number(r[c]) or 0 for r in src) for c in cols}
print("== stall-sample totals per column (all instructions)")
for c, t in sorted(totals.items(), key=lambda kv: -kv[1]):
    if t:
        print(f"  {t:10.0f}  {c}")
key = next((c for c in cols if "All Samples" in c), cols[0] if cols else None)
if key:
    total = totals[key] or 1
    print(f"== top 30 instructions by '{key}' (of {total:.0f})")
    for r in sorted(src, key=lambda r: -(number(r[key]) or 0))[:30]:
        reasons = sorted(((number(r[c]) or 0, c) for c in cols if c != key and "Samples" not in c), reverse=True)[:2]
        why = ", ".join(f"{c}={v:.0f}" for v, c in reasons if v)
        print(f"  {r.get('Address', ''):>8s} {100 * (number(r[key]) or 0) / total:5.1f}%  {r.get('Source', '')[:60]:60s} {why}")
    per_op = collections.Counter()
    for r in src:
        op = r.get("Source", "").split()
        op = [t for t in op if not t.startswith("@")]
        per_op[op[0].split(".")[0] if op else "?"] += number(r[key]) or 0
    print("== samples per opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in per_op.most_common(12)))
EOF
else
  echo "ncu failed (rc=$ncu_rc)"
fi
echo "(total $(( $(date +%s) - start )) s)"
exit "$bench_rc"
