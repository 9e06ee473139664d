# call 2 (fresh machine): gpu_check of the bound token append (memcheck on the token kernels), then e1 base/new
# alternating and the tokens-after-result experiment on the new wheel
T0=$SECONDS
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2e/pytw/*.whl .whl/
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-210} KVCANARY_CACHE_DIR=/tmp/kvc \
  GPU_CHECK_MEMCHECK_K="cuda and (token or append or bound)" bash integration/gpu_check.sh > /tmp/gc.log 2>&1
echo "gpu_check rc=$? at $((SECONDS - T0)) s"
grep "^\[gpu_check\]" /tmp/gc.log | head -20; grep -hE "^(FAILED|ERROR) " $OUT_GC/*.log | head
cp $OUT_GC/gpu_check.md $OUT/ 2>/dev/null; (cd $OUT_GC && tar czf $OUT/gc-logs.tgz *.log *.md 2>/dev/null); rm -rf $OUT_GC
RUNS="${RUNS:-e1:base e1:new e1:new e1:base e1x:new}" TAG=2 END_S=${END_S:-585} T0=$T0 bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
