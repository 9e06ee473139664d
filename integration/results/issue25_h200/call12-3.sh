# Issue 25, twelfth session, call 3 (fresh): gpu_check's setup/build/gpu-tests/kernels after the CUDA test fix, and
# memcheck over the bound launches' CUDA tests (the step's other cases ran in call 1, csrc unchanged since).
T0=$SECONDS; mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; [ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2ewhl/ninja-* .whl/; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-150} KVCANARY_CACHE_DIR=/tmp/kvc \
  GPU_CHECK_MEMCHECK_K="cuda and (bound_launches or bound_check_equals or bound_write_equals or bound_check_writes)" \
  PYTHONPATH=$PWD/.e2e/pyt bash integration/gpu_check.sh > $OUT/gc3.log 2>&1; echo "gpu_check rc=$? at $((SECONDS - T0)) s"
tar czf $OUT/gc3-logs.tgz -C $OUT_GC . && rm -rf $OUT_GC; grep "^\[gpu_check\]" $OUT/gc3.log
