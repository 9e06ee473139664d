# Session 20, call 3: more alternating pairs of main (base = f201172) and the C decode post (new = this session's
# HEAD): e1 two pairs, e2 one pair.
T0=$SECONDS
RUNS="${RUNS:-e1:base e1:new e2:new e2:base e1:new e1:base}" TAG=3 END_S=$((${END_S:-470} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
