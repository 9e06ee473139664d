# Issue 25, fourteenth session, call 1 (fresh machine): gpu_check up to the memcheck of the bound launches (csrc
# unchanged since 7acf979: the kernels' differential tests, the GPU graph tests, the bound write's ring test fixed after
# the last session's run), then e2 and e1, the before (c684c2e) against HEAD.
T0=$SECONDS; [ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; [ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2ewhl/ninja-* .whl/
S=/tmp/site; if [ ! -d $S/sglang ]; then python3 -m pip install -q --no-index --no-deps \
  --no-compile --no-cache-dir --upgrade --target $S .e2ewhl/*.whl >/tmp/pip.log 2>&1; find $S -xdev -exec touch -h \
  -m -d '2000-01-01 00:00:00' {} +; tar xJf .e2e/caches.txz -C /tmp; fi
mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
echo "setup $((SECONDS - T0)) s"
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-170} KVCANARY_CACHE_DIR=/tmp/kvc \
  GPU_CHECK_MEMCHECK_K="cuda and (bound_write_equals or bound_check_equals or bound_launches)" \
  PYTHONPATH=$PWD/.e2e/pyt bash integration/gpu_check.sh > /tmp/gc1.log 2>&1; echo "gpu_check rc=$? at $((SECONDS - T0)) s"
grep "^\[gpu_check\]" /tmp/gc1.log | head -20; grep -E "^(FAILED|ERROR) " $OUT_GC/*.log | head
cp /tmp/gc1.log $OUT/; cp $OUT_GC/gpu_check.md $OUT/ 2>/dev/null
(cd $OUT_GC && tar czf $OUT/gc-logs.tgz *.log *.md *.json 2>/dev/null); rm -rf $OUT_GC
RUNS="${RUNS:-e2:iss e2:new e1:new e1:iss}" TAG=1 END_S=${END_S:-585} T0=$T0 bash .e2e/ab14.sh
