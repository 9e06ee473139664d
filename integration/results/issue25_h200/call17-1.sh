# Session 17, call 1 (fresh): gpu_check of the fused deferred write's csrc (the previous forward's write run by the
# next check launch), then e0 (eager PARTIAL) fused / main.
T0=$SECONDS
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2e/pytw/*.whl .whl/
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-230} KVCANARY_CACHE_DIR=/tmp/kvc \
  GPU_CHECK_MEMCHECK_K="cuda and (deferred_write or bound_launches or bound_check_equals or bound_write_equals or bound_check_writes or status_mirror or token_mail)" \
  bash integration/gpu_check.sh > /tmp/gc.log 2>&1
echo "gpu_check rc=$? at $((SECONDS - T0)) s"
grep "^\[gpu_check\]" /tmp/gc.log | head -20; grep -hE "^(FAILED|ERROR) " $OUT_GC/*.log | head
cp $OUT_GC/gpu_check.md $OUT/ 2>/dev/null; (cd $OUT_GC && tar czf $OUT/gc-logs.tgz *.log *.md 2>/dev/null); rm -rf $OUT_GC
RUNS="${RUNS:-e0:fused e0:main}" TAG=1 END_S=$((${END_S:-560} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
