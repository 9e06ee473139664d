# Session 19, call 2 (fresh): the full gpu_check of csrc digest 636dcb2f (csrc unchanged since the seventeenth
# session; its full run there had one test bug, fixed, and no full rerun since), then e1 and e2 of main (f201172,
# wheel w-base) on this session's hosts.
T0=$SECONDS
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2e/pytw/*.whl .whl/
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-380} KVCANARY_CACHE_DIR=/tmp/kvc \
  bash integration/gpu_check.sh > /tmp/gc.log 2>&1
echo "gpu_check rc=$? at $((SECONDS - T0)) s"
grep "^\[gpu_check\]" /tmp/gc.log | head -20; grep -hE "^(FAILED|ERROR) " $OUT_GC/*.log | head
cp $OUT_GC/gpu_check.md $OUT/ 2>/dev/null; (cd $OUT_GC && tar czf $OUT/gc-logs.tgz *.log *.md 2>/dev/null); rm -rf $OUT_GC
sed -n '/| step |/,/^$/p' $OUT/gpu_check.md
RUNS="${RUNS:-e1:base e2:base}" TAG=2 END_S=$((${END_S:-575} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
