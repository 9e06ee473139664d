# Session 18, call 2 (fresh): e2 base / new alternating (the probe's kvcanary pieces off), then phases 2 and 3 with
# sglang's decode graphs on the new wheel (the token mail's post from the batch hook: token_swap must stay 100 %).
# As run: RUNS="g23:new e2:new e2:base e2:base e2:new" END_S=520 bash .e2e/call2.sh (the first attempt of this call, with the default RUNS, was taken back with no result)
T0=$SECONDS
RUNS="${RUNS:-e2:new e2:base e2:base e2:new g23:new}" TAG=2 END_S=$((${END_S:-575} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
