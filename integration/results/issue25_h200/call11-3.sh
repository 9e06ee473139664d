# Issue 25, eleventh session, call D (fresh): gpu_check of the final csrc (the status mirror alone, after the deferred
# write's revert; the CUDA module prebuilt here, carried in .e2e/kvc.txz).
T0=$SECONDS; [ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; [ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2ewhl/ninja-* .whl/
mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
echo "setup $((SECONDS - T0)) s"
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
GPU_CHECK_MEMCHECK_K="${MEMCHECK_K:-cuda and (status_mirror or 0-cuda or out_of_range)}" OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-320} KVCANARY_CACHE_DIR=/tmp/kvc \
  PYTHONPATH=$PWD/.e2e/pyt bash integration/gpu_check.sh > /tmp/gc.log 2>&1; echo "gpu_check rc=$? at $((SECONDS - T0)) s"
sed -n "/^| step/,/^$/p" $OUT_GC/gpu_check.md 2>/dev/null || tail -30 /tmp/gc.log
grep -n "FAILED\|Error" /tmp/gc.log | head -10
cp /tmp/gc.log $OUT/; cd $OUT_GC && tar czf ../gc-logs.tgz . ; ls -la $OUT
