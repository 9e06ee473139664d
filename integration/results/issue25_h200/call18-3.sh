# Session 18, call 3 (warm): e1 base / new alternating, two more pairs (the probe's kvcanary pieces off).
T0=$SECONDS; RUNS="e1:base e1:new e1:new e1:base" TAG=3 END_S=300 bash .e2e/ab.sh; echo "total $((SECONDS - T0)) s"
