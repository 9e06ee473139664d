# Session 18, call 1 (fresh): e0 and e1, base (b1b641a) / new alternating, the probe's kvcanary pieces off.
T0=$SECONDS
RUNS="${RUNS:-e0:new e0:base e1:base e1:new e0:base e0:new e1:new e1:base}" TAG=1 END_S=$((${END_S:-565} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
