# call 1 (fresh machine): e1 with the tokens-after-result experiment, e0, e1; then the JIT caches to $OUT
T0=$SECONDS
RUNS="${RUNS:-e1x:new e0:new e1:new}" TAG=1 END_S=${END_S:-400} T0=$T0 bash .e2e/ab.sh
cd /tmp && tar czf $OUT/caches.tgz triton-cache fi-ws tvmffi-cache nv-cache torchinductor 2>/dev/null; ls -la $OUT; echo "total $((SECONDS - T0)) s"
