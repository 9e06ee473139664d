# Session 16, call 3 (fresh): the whole gpu_check of main's csrc (unchanged since 309017a; call 1's memcheck ran out
# of budget, its benches were skipped), then e1 new (93e5622: the mail) / new2 (the cheaper post) alternating, e2 new2.
T0=$SECONDS
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2e/pytw/*.whl .whl/
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-190} KVCANARY_CACHE_DIR=/tmp/kvc \
  GPU_CHECK_MEMCHECK_K="cuda and (token_mail or bound_append or status_mirror or bound_launches or bound_check_equals or bound_write_equals or bound_check_writes or refuses_a_staging)" \
  bash integration/gpu_check.sh > /tmp/gc.log 2>&1
echo "gpu_check rc=$? at $((SECONDS - T0)) s"
grep "^\[gpu_check\]" /tmp/gc.log | head -20; grep -hE "^(FAILED|ERROR) " $OUT_GC/*.log | head
cp $OUT_GC/gpu_check.md $OUT/ 2>/dev/null; (cd $OUT_GC && tar czf $OUT/gc-logs.tgz *.log *.md 2>/dev/null); rm -rf $OUT_GC
RUNS="${RUNS:-e1:new2 e1:new e1:new e1:new2 e2:new2}" TAG=3 END_S=$((${END_S:-450} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
