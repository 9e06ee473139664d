# Issue 25, twelfth session, call 1 (fresh machine): the bound launches validated once at binding. gpu_check (csrc
# changed: the CUDA module prebuilt here, carried in .kvc), then e0 (eager PARTIAL) old / new (wheels of 0f468c6 and
# HEAD), the first pair of the A/B.
T0=$SECONDS; [ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; [ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2ewhl/ninja-* .whl/
S=/tmp/site; if [ ! -d $S/sglang ]; then python3 -m pip install -q --no-index --no-deps \
  --no-compile --no-cache-dir --upgrade --target $S .e2ewhl/*.whl >/tmp/pip.log 2>&1; find $S -xdev -exec touch -h \
  -m -d '2000-01-01 00:00:00' {} +; tar xJf .e2e/caches.txz -C /tmp; fi
[ -d .kvc ] && mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
echo "setup $((SECONDS - T0)) s"
OUT_GC=$OUT/gc; mkdir -p $OUT_GC
OUT=$OUT_GC GPU_CHECK_SITE=/tmp/gsite GPU_CHECK_BUDGET_S=${GC_BUDGET:-330} KVCANARY_CACHE_DIR=/tmp/kvc \
  PYTHONPATH=$PWD/.e2e/pyt bash integration/gpu_check.sh > /tmp/gc.log 2>&1; echo "gpu_check rc=$? at $((SECONDS - T0)) s"
sed -n "/^| step/,/^$/p" $OUT_GC/gpu_check.md 2>/dev/null || tail -30 /tmp/gc.log
cp /tmp/gc.log $OUT/
M=/tmp/kvc/0.1.0-; V=cuda-sm90a-tvmffi0.1.9/kvcanary_ops.so
PYTHONPATH=/tmp/gsite:$PWD/plugin:$PWD/benchmarks timeout 60 python3 benchmarks/bench_launch_ab.py \
  --old ${M}a8f271f7acc5c7e2/$V --new ${M}5f54fe23b9bf161f/$V > $OUT/launch_ab.md 2>&1; cat $OUT/launch_ab.md | tail -8
RUNS="${RUNS:-e0:old e0:new}" TAG=1 END_S=${END_S:-585} T0=$T0 bash .e2e/ab.sh
