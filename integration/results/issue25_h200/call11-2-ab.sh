# Issue 25, eleventh session, call B: main before this session (1690059, w-old) against HEAD (w-new) in ONE call on one
# machine, alternating wheels under today's driver: ${RUNS:-e0 old/new pairs, then pd pairs}. e0 = eager PARTIAL
# (phase 1, 120 requests); pd = the product's defaults (piecewise prefill + decode graphs, PARTIAL, no token check,
# no sweep: phase 2 --piecewise). Loop probe, stats every 1000.
T0=$SECONDS; [ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; END=${END_S:-570}; [ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
S=/tmp/site; if [ ! -d $S/sglang ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target $S .e2ewhl/*.whl >/tmp/pip.log 2>&1; find $S -xdev -exec touch -h -m -d '2000-01-01 00:00:00' {} +; \
  tar xJf .e2e/caches.txz -C /tmp; fi
[ -d .kvc ] && mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
echo "setup $((SECONDS - T0)) s"
K="--loop-probe --kvcanary-env KVCANARY_STATS_EVERY=1000 --kvcanary-env KVCANARY_VERIFY_TOKENS=0 --kvcanary-env KVCANARY_SWEEP_INTERVAL=0"
i=0
for run in ${RUNS:-e0:old e0:new e0:new e0:old e0:old e0:new}; do
  s=${run%:*}; w=${run#*:}; i=$((i + 1)); left=$((END - SECONDS))
  need=70; [ $s = pd ] && need=80
  [ $left -lt $need ] && { echo "stop before $run: $left s left"; break; }
  cp .e2e/w-$w/kvcanary-0.1.0-py3-none-any.whl .e2ewhl/
  n=ab${TAG:-}$i-$s-$w
  if [ $s = e0 ]; then bash integration/h200_e2e.sh $n --phases 1 --requests 120 $K --budget 124 > /tmp/$n.log 2>&1
  else bash integration/h200_e2e.sh $n --phases 2 --piecewise $K --cold-start-s 150 --budget 200 > /tmp/$n.log 2>&1; fi
  rc=$?; P=$([ $s = e0 ] && echo phase1-clean || echo phase2-graph)
  W=$(ls -d /tmp/e2e-$n/phase* 2>/dev/null | head -1)
  line=$(grep -ohE "kvcanary host time: step=1000 .*" $W/worker.log 2>/dev/null | tail -1)
  echo "$i $s $w rc=$rc t=$((SECONDS - T0)) | $(grep -E '^\| [12] ' /tmp/$n.log | cut -d'|' -f5,10,13,16,17)"
  echo "  $line" | cut -c1-260
  grep -v "^\[e2e-probe\]" /tmp/$n.log > $OUT/$n.log
  grep -hE "^\[e2e-probe\]|measured workload|kvcanary host time|kvcanary stats" $W/worker.log > $OUT/probe-$n.log 2>/dev/null
done
cd $OUT && tar czf ab${TAG:-}-logs.tgz *.log && rm -f *.log; ls -la $OUT
