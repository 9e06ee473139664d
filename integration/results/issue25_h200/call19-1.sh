# Session 19, call 1 (fresh): where the eager check launch sits (issue 25): base = f201172 (the check first, before
# the model), new = the check right after the model. (1) bench_forward_path on the H200 with a stand-in model of 20
# launches and cold caches, base / new alternating: kvcanary's launches and the model's own host time side by side
# (a cost moved from kvcanary's launch to the model's first launch shows in the model's column); (2) the engine:
# e0 and e1 base / new alternating.
# As run: the base bench steps failed at import (.e2e/base-plugin was a copy of plugin/ without include/ and csrc/ beside it,
# which the JIT needs); the new bench steps and the six engine runs ran. The experiment's change: call19-check-after-model.diff.
T0=$SECONDS
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --target /tmp/bsite .e2ewhl/apache_tvm_ffi-*.whl > /tmp/bpip.log 2>&1
for t in new base new base; do
  P=$PWD/plugin; [ $t = base ] && P=$PWD/.e2e/base-plugin
  echo "== bench $t"
  KVCANARY_CACHE_DIR=/tmp/kvc PYTHONPATH=$P:/tmp/bsite timeout 100 python3 benchmarks/bench_forward_path.py --device cuda \
    --cases "decode bs64 PARTIAL + deferred write,extend bs64 PARTIAL,decode bs64 PARTIAL + tokens + deferred write" \
    --model-launches 20 --cold 64 --forwards 30 --rounds 5 > $OUT/bench-$t.md 2> /tmp/bench-$t.err
  echo "rc=$? t=$((SECONDS - T0))"; grep -E "µs \(HostTime" /tmp/bench-$t.err; grep -iE "error|Traceback" /tmp/bench-$t.err | head -3
done
RUNS="${RUNS:-e0:new e0:base e1:new e1:base e0:base e0:new}" TAG=1 END_S=$((${END_S:-575} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
