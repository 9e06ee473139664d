# Session 16, call 1 (fresh): gpu_check of main's csrc (the mail before the verify; never run on the GPU), then
# phases 2 and 3 with decode graphs with the adapter opening the token mail (w-new = 93e5622), then e1 base / new.
T0=$SECONDS
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2e/pytw/*.whl .whl/
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-215} KVCANARY_CACHE_DIR=/tmp/kvc \
  bash integration/gpu_check.sh > /tmp/gc.log 2>&1
echo "gpu_check rc=$? at $((SECONDS - T0)) s"
grep "^\[gpu_check\]" /tmp/gc.log | head -20; grep -hE "^(FAILED|ERROR) " $OUT_GC/*.log | head
cp $OUT_GC/gpu_check.md $OUT/ 2>/dev/null; (cd $OUT_GC && tar czf $OUT/gc-logs.tgz *.log *.md 2>/dev/null); rm -rf $OUT_GC
RUNS="${RUNS:-g23:new e1:base e1:new}" TAG=1 END_S=${END_S:-565} T0=$T0 bash .e2e/ab.sh
cd /tmp && tar cJf $OUT/caches.txz triton-cache fi-ws tvmffi-cache nv-cache torchinductor 2>/dev/null
echo "total $((SECONDS - T0)) s"
