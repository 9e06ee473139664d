# Issue 25, twelfth session, call 2 (fresh machine): gpu_check's setup/build/gpu-tests/kernels (the two test fixes of
# call 1's failures), then the A/B's pairs 2 and 3 (e0), phases 2 and 3 with decode graphs (correctness of the new
# wheel), and pd old/new while time is left.
T0=$SECONDS; [ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; [ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2ewhl/ninja-* .whl/
S=/tmp/site; if [ ! -d $S/sglang ]; then python3 -m pip install -q --no-index --no-deps \
  --no-compile --no-cache-dir --upgrade --target $S .e2ewhl/*.whl >/tmp/pip.log 2>&1; find $S -xdev -exec touch -h \
  -m -d '2000-01-01 00:00:00' {} +; tar xJf .e2e/caches.txz -C /tmp; fi
[ -d .kvc ] && mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
echo "setup $((SECONDS - T0)) s"
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-135} KVCANARY_CACHE_DIR=/tmp/kvc \
  PYTHONPATH=$PWD/.e2e/pyt bash integration/gpu_check.sh > /tmp/gc2.log 2>&1; echo "gpu_check rc=$? at $((SECONDS - T0)) s"
grep "^\[gpu_check\]" /tmp/gc2.log; grep -E "^(FAILED|ERROR) " $OUT_GC/*.log | head; cp /tmp/gc2.log $OUT/; rm -rf $OUT_GC
RUNS="${RUNS:-e0:new e0:old g23:new e0:old e0:new pd:old pd:new}" TAG=2 END_S=${END_S:-588} T0=$T0 bash .e2e/ab.sh
