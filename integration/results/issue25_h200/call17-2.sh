# Session 17, call 2 (fresh): the deferred-write GPU tests after the test fix (kernels + runtime, gpu marker), then
# phase 3 (faults, log mode) with every forward eager (each decode's write deferred into the next check launch),
# then an e0 pair.
T0=$SECONDS
mkdir -p .whl && cp .e2ewhl/apache_tvm_ffi-* .e2e/pytw/*.whl .whl/
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --target /tmp/gsite .whl/*.whl > /tmp/gpip.log 2>&1
PYTHONPATH=/tmp/gsite:$PWD/plugin KVCANARY_CACHE_DIR=/tmp/kvc KVCANARY_CUDA_ARCH=9.0a CUDA_HOME=/usr/local/cuda \
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_deferred_write.py \
  tests/runtime/test_deferred_writes.py tests/kernels/test_bound_launch.py > $OUT/gpu-deferred-tests.log 2>&1
echo "gpu deferred tests rc=$? at $((SECONDS - T0)) s: $(tail -1 $OUT/gpu-deferred-tests.log)"
RUNS="${RUNS:-g3e:fused e0:main e0:fused}" TAG=2 END_S=$((${END_S:-570} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
