# e0 / pd runs alternating wheels (.e2e/w-old, .e2e/w-new) in one call: RUNS="e0:old e0:new ...", END_S (seconds of
# the call's clock T0), TAG (log names). e0 = eager PARTIAL (phase 1, 120 requests); pd = the product's defaults
# (phase 2 --piecewise); g23 = phases 2 and 3 with decode graphs (correctness, the given wheel). Loop probe, stats
# every 1000.
T0=${T0:-$SECONDS}; END=${END_S:-570}
[ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
S=/tmp/site; if [ ! -d $S/sglang ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target $S .e2ewhl/*.whl >/tmp/pip.log 2>&1; find $S -xdev -exec touch -h -m -d '2000-01-01 00:00:00' {} +; \
  tar xJf .e2e/caches.txz -C /tmp; fi
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
K0="--kvcanary-env KVCANARY_STATS_EVERY=1000 --kvcanary-env KVCANARY_VERIFY_TOKENS=0 --kvcanary-env KVCANARY_SWEEP_INTERVAL=0"
K="--loop-probe $K0"
# e0n: e0 without the loop probe (its timers sit inside kvcanary's accounting); e1: eager + token check; e2: eager +
# token check + sweep every 10
K1="--loop-probe --kvcanary-env KVCANARY_STATS_EVERY=1000 --kvcanary-env KVCANARY_VERIFY_TOKENS=1 --kvcanary-env KVCANARY_SWEEP_INTERVAL=0"
K2="--loop-probe --kvcanary-env KVCANARY_STATS_EVERY=1000 --kvcanary-env KVCANARY_VERIFY_TOKENS=1 --kvcanary-env KVCANARY_SWEEP_INTERVAL=10"
i=0
for run in $RUNS; do
  s=${run%:*}; w=${run#*:}; i=$((i + 1)); left=$((END - (SECONDS - T0)))
  need=70; [ $s = pd ] && need=120; [ $s = g23 ] && need=200
  [ $left -lt $need ] && { echo "stop before $run: $left s left"; break; }
  cp .e2e/w-$w/kvcanary-0.1.0-py3-none-any.whl .e2ewhl/
  n=ab${TAG:-}$i-$s-$w
  if [ $s = e0 ]; then bash integration/h200_e2e.sh $n --phases 1 --requests 120 $K --budget 124 > /tmp/$n.log 2>&1
  elif [ $s = e0n ]; then bash integration/h200_e2e.sh $n --phases 1 --requests 120 $K0 --budget 124 > /tmp/$n.log 2>&1
  elif [ $s = e1 ]; then bash integration/h200_e2e.sh $n --phases 1 --requests 120 $K1 --budget 124 > /tmp/$n.log 2>&1
  elif [ $s = e2 ]; then bash integration/h200_e2e.sh $n --phases 1 --requests 120 $K2 --budget 124 > /tmp/$n.log 2>&1
  elif [ $s = pd ]; then bash integration/h200_e2e.sh $n --phases 2 --piecewise $K --cold-start-s 150 --budget 200 > /tmp/$n.log 2>&1
  else bash integration/h200_e2e.sh $n --phases 2,3 --loop-probe --kvcanary-env KVCANARY_STATS_EVERY=1000 --cold-start-s 60 --budget $((left - 10)) > /tmp/$n.log 2>&1; fi
  rc=$?
  echo "$i $s $w rc=$rc t=$((SECONDS - T0)) | $(grep -E '^\| [123] ' /tmp/$n.log | cut -d'|' -f2,5,10,13,16,17 | tr '\n' ' ')"
  for W in /tmp/e2e-$n/phase*; do
    line=$(grep -ohE "kvcanary host time: step=1000 .*" $W/worker.log 2>/dev/null | tail -1)
    echo "  $(basename $W): $line" | cut -c1-300
    grep -hE "^\[e2e-probe\]|measured workload|kvcanary host time|kvcanary stats" $W/worker.log > $OUT/probe-$n-$(basename $W).log 2>/dev/null
  done
  grep -v "^\[e2e-probe\]" /tmp/$n.log > $OUT/$n.log
done
cd $OUT && tar czf ab${TAG:-}-logs.tgz *.log && rm -f *.log; tar czf /tmp/all-out.tgz -C $OUT . && find $OUT -mindepth 1 -delete && mv /tmp/all-out.tgz $OUT/all.tgz; ls -la $OUT
