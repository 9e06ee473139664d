# Issue 25, fifteenth session (g3e: seventeenth; PIECES: eighteenth): runs in one call. RUNS="e1x:new e0:new ..." (wheel w-<name> in .e2e), END_S (seconds of
# the call's clock T0), TAG (log names). e0 = eager PARTIAL (phase 1, 120 requests); e1 = + token check; e1x = e1 with
# the probe's tokens-after-result experiment; e2 = + token check + sweep every 10; pd = the product's defaults (phase 2
# --piecewise); g23 = phases 2 and 3 with decode graphs (correctness). Loop probe, stats every 1000.
T0=${T0:-$SECONDS}; END=${END_S:-570}
S=/tmp/site; if [ ! -d $S/sglang ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target $S .e2ewhl/*.whl >/tmp/pip.log 2>&1; find $S -xdev -exec touch -h -m -d '2000-01-01 00:00:00' {} +; \
  [ -f .e2e/caches.txz ] && tar xJf .e2e/caches.txz -C /tmp; fi
[ -d .kvc ] || { mkdir -p .kvc && tar xJf .e2e/kvc.txz -C .kvc; }; mkdir -p /tmp/kvc && cp -an .kvc/. /tmp/kvc/ 2>/dev/null
R=$PWD
K0="--kvcanary-env KVCANARY_STATS_EVERY=1000"
K="--loop-probe $K0 --kvcanary-env KVCANARY_VERIFY_TOKENS=0 --kvcanary-env KVCANARY_SWEEP_INTERVAL=0"
K1="--loop-probe $K0 --kvcanary-env KVCANARY_VERIFY_TOKENS=1 --kvcanary-env KVCANARY_SWEEP_INTERVAL=0"
K2="--loop-probe $K0 --kvcanary-env KVCANARY_VERIFY_TOKENS=1 --kvcanary-env KVCANARY_SWEEP_INTERVAL=10"
i=0
for run in $RUNS; do
  s=${run%:*}; w=${run#*:}; i=$((i + 1)); left=$((END - (SECONDS - T0)))
  need=70; [ $s = pd ] && need=120; [ $s = g23 ] && need=200; [ $s = g3e ] && need=200; [ -d /tmp/triton-cache ] || need=$((need + 90))
  [ $left -lt $need ] && { echo "stop before $run: $left s left"; break; }
  cp .e2e/w-$w/kvcanary-0.1.0-py3-none-any.whl .e2ewhl/
  n=ab${TAG:-}$i-$s-$w; X=
  case $s in
    e0) A="--phases 1 --requests 120 $K --budget 124";;
    e1) A="--phases 1 --requests 120 $K1 --budget 124";;
    e1x) A="--phases 1 --requests 120 $K1 --budget 124"; X=1;;
    e2) A="--phases 1 --requests 120 $K2 --budget 124";;
    pd) A="--phases 2 --piecewise $K --cold-start-s 150 --budget 200";;
    g3e) A="--phases 3 --engine-arg disable_cuda_graph=true --loop-probe $K0 --cold-start-s 60 --budget $((left - 10))";;
    *) A="--phases 2,3 --loop-probe $K0 --cold-start-s 60 --budget $((left - 10))";;
  esac
  # PIECES=1: the probe also times kvcanary's pieces (their wrappers then run inside kvcanary's own host time)
  [ $i = 1 ] && [ $s != g23 ] && [ $s != pd ] && [ $s != g3e ] && A="$A --cold-start-s 90"
  (E2E_LOOP_PROBE_KVC_PIECES=${PIECES:-0} E2E_LOOP_PROBE_TOKENS_AFTER_RESULT=$X OUT=/tmp/abo bash integration/h200_e2e.sh $n $A) > /tmp/$n.log 2>&1
  rc=$?
  echo "$i $s $w rc=$rc t=$((SECONDS - T0)) | $(grep -E '^\| [123] ' /tmp/$n.log | cut -d'|' -f2,5,10,13,16,17 | tr '\n' ' ')"
  for W in /tmp/e2e-$n/phase*; do
    line=$(grep -ohE "kvcanary host time: step=1000 .*" $W/worker.log 2>/dev/null | tail -1)
    echo "  $(basename $W): $line" | cut -c1-400
    grep -hE "^\[e2e-probe\]|measured workload|kvcanary host time|kvcanary stats|sweep source|host extension|Traceback|Error" $W/worker.log > $OUT/probe-$n-$(basename $W).log 2>/dev/null
  done
  grep -hm2 "host extension" /tmp/e2e-$n/phase*/worker.log 2>/dev/null | cut -c1-300
  grep -v "^\[e2e-probe\]" /tmp/$n.log > $OUT/$n.log
done
cd $OUT && tar czf ab${TAG:-}-logs.tgz *.log && rm -f *.log
