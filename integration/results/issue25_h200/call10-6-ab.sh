# How its inputs were made (on the dev machine, into the ignored .e2e/):
#   git archive c684c2e | tar -x -C /tmp/old && pip wheel --no-deps --no-build-isolation /tmp/old -w .e2e/w-old
#   mkdir -p .e2e/w-new && cp .e2ewhl/kvcanary-0.1.0-py3-none-any.whl .e2e/w-new/     # main's plugin (16208ec)
#   git archive c684c2e integration | tar -x -C .e2e/old-integ                          # the old wheel's own driver
# Run on the device: END_S=420 bash .e2e/call5.sh
# Issue 25: the before (c684c2e) against main (wheel of 16208ec = HEAD's plugin) in ONE call on one machine,
# alternating wheels: eager PARTIAL (e0) and eager + token check + sweep 10 (e2), loop probe, stats every 1000.
T0=$SECONDS; END=${END_S:-560}; [ -d .e2e/pyt ] || tar xJf .e2e/pyt.txz -C .e2e
S=/tmp/site; if [ ! -d $S/sglang ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target $S .e2ewhl/*.whl >/tmp/pip.log 2>&1; find $S -xdev -exec touch -h -m -d '2000-01-01 00:00:00' {} +; \
  tar xJf .e2e/caches.txz -C /tmp; fi
echo "setup $((SECONDS - T0)) s"
K="--loop-probe --kvcanary-env KVCANARY_STATS_EVERY=1000"
E0="--kvcanary-env KVCANARY_VERIFY_TOKENS=0 --kvcanary-env KVCANARY_SWEEP_INTERVAL=0"
i=0
R=$PWD; mkdir -p /tmp/oldroot && ln -sfn $R/.e2e/old-integ/integration /tmp/oldroot/integration && \
  ln -sfn $R/.e2e /tmp/oldroot/.e2e && ln -sfn $R/.e2ewhl /tmp/oldroot/.e2ewhl
for run in e0:old e0:new e0:new e0:old e0:old e0:new; do
  s=${run%:*}; w=${run#*:}; i=$((i + 1)); left=$((END - SECONDS))
  need=75; [ $w = old ] && [ ! -f /tmp/old-built ] && need=160
  [ $left -lt $need ] && { echo "stop before $run: $left s left"; break; }
  cp .e2e/w-$w/kvcanary-0.1.0-py3-none-any.whl .e2ewhl/
  [ $s = e0 ] && X="$E0" || X=""
  # the old wheel runs under the old tree's driver (c684c2e's package has no kvcanary.kernels; its driver knows it)
  [ $w = old ] && D=/tmp/oldroot || D=$R
  (cd $D && OUT=/tmp/abo bash integration/h200_e2e.sh ab$i-$s-$w --phases 1 --requests 120 $K $X --budget 124) > /tmp/ab$i.log 2>&1
  rc=$?; [ $w = old ] && touch /tmp/old-built
  line=$(grep -oE "kvcanary host time: step=1000 .*" /tmp/e2e-ab$i-$s-$w/phase1-clean/worker.log | tail -1)
  echo "$i $s $w rc=$rc t=$((SECONDS - T0)) | $(grep -E '^\| 1 ' /tmp/ab$i.log | cut -d'|' -f5,10,13,16,17)"
  echo "  $line" | cut -c1-220
  grep -v "^\[e2e-probe\]" /tmp/ab$i.log > $OUT/ab$i-$s-$w.log
  grep -E "^\[e2e-probe\]|measured workload|kvcanary host time" /tmp/e2e-ab$i-$s-$w/phase1-clean/worker.log > $OUT/probe-ab$i-$s-$w.log 2>/dev/null
done
cd $OUT && tar czf ab-logs.tgz *.log -C /tmp abo && rm -f ab*.log probe-*.log; ls -la $OUT
