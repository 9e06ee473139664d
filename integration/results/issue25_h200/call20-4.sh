# Session 20, call 4: one more alternating e2 pair (base = f201172, new = the C decode post).
T0=$SECONDS
RUNS="${RUNS:-e2:base e2:new}" TAG=4 END_S=$((${END_S:-290} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
