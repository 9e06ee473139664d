# Issue 25, eleventh session, call A (fresh machine): the status mirror + deferred write. gpu_check (csrc changed:
# the CUDA module prebuilt here, carried in .kvc), then phase 3 (faults) with every forward eager (disable_cuda_graph:
# the adapter defers writes), stats every 1000 (wheel of HEAD).
T0=$SECONDS; [ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; [ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2ewhl/ninja-* .whl/
S=/tmp/site; if [ ! -d $S/sglang ]; then python3 -m pip install -q --no-index --no-deps \
  --no-compile --no-cache-dir --upgrade --target $S .e2ewhl/*.whl >/tmp/pip.log 2>&1; find $S -xdev -exec touch -h \
  -m -d '2000-01-01 00:00:00' {} +; tar xJf .e2e/caches.txz -C /tmp; fi
[ -d .kvc ] && mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
echo "setup $((SECONDS - T0)) s"
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-290} KVCANARY_CACHE_DIR=/tmp/kvc \
  PYTHONPATH=$PWD/.e2e/pyt bash integration/gpu_check.sh > /tmp/gc.log 2>&1; echo "gpu_check rc=$? at $((SECONDS - T0)) s"
sed -n "/^| step/,/^$/p" $OUT_GC/gpu_check.md 2>/dev/null || tail -30 /tmp/gc.log
B=$((${END_S:-575} - SECONDS)); echo "phase 3 budget $B s"
bash integration/h200_e2e.sh g3e --phases 3 --engine-arg disable_cuda_graph=true \
  --kvcanary-env KVCANARY_STATS_EVERY=1000 --cold-start-s 60 --budget $B > /tmp/g3e.log 2>&1
echo "g3e rc=$? at $((SECONDS - T0)) s"; grep -E "^\| 3 |RESULT|late|detected" /tmp/g3e.log | cut -c1-400 | tail -8
grep -h "defer their record writes" /tmp/e2e-g3e/phase*/worker.log | head -2
cp /tmp/g3e.log /tmp/gc.log $OUT/; [ -d /tmp/e2e-g3e ] && tar czf $OUT/e2e-g3e.tgz -C /tmp e2e-g3e; ls -la $OUT
