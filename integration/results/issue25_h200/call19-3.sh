# Session 19, call 3 (fresh): gpu_check's memcheck step alone, as gpu_check.sh runs it (call 2's timed out at its
# 150 s step timeout with 30 of its 45 tests done; the step now has 300 s), then e1 / e2 of main if time is left.
T0=$SECONDS
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --target /tmp/msite .e2ewhl/apache_tvm_ffi-*.whl .e2e/pytw/*.whl > /tmp/mpip.log 2>&1
K='cuda and (out_of_range or 0-cuda or 1-cuda or refuses_a_staging or commit_past_the_block_cap or index_plans_equal_the_cpu_index or status_mirror or bound_launches or bound_check_equals or bound_write_equals or bound_check_writes or token_mail or bound_append or deferred_write)'
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
KVCANARY_CACHE_DIR=/tmp/kvc PYTHONPATH=/tmp/msite:plugin PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 $SAN --tool memcheck \
  --error-exitcode 1 --target-processes all --print-limit 50 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/kernels/test_differential.py tests/kernels/test_out_of_range.py tests/kernels/test_kernel_attribution.py \
  tests/kernels/test_check.py tests/kernels/test_token_update.py tests/kernels/test_sweep_plan_update.py \
  tests/kernels/test_bound_launch.py -k "$K" > $OUT/memcheck.log 2>&1
echo "memcheck rc=$? t=$((SECONDS - T0)) s"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.log | tail -3
RUNS="${RUNS:-e1:base e2:base}" TAG=3 END_S=$((${END_S:-470} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
