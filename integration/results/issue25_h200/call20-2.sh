# Session 20, call 2: correctness of the new wheel (phases 2 and 3 with decode graphs: raise mode with the token check
# and sweep; the fault classes, token_swap among them), then e2 (eager + token check + sweep every 10) base / new
# alternating, two pairs. base = f201172, new = this session's HEAD (the C decode post).
T0=$SECONDS
RUNS="${RUNS:-g23:new e2:new e2:base e2:base e2:new}" TAG=2 END_S=$((${END_S:-585} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
