# Session 17, call 4 (fresh): a second e1 pair and a fourth e0 pair (fused first in e1, main first in e0).
T0=$SECONDS
RUNS="${RUNS:-e1:fused e1:main e0:main e0:fused}" TAG=4 END_S=${END_S:-320} bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
