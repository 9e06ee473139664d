# Issue 25, thirteenth session, call 2 (fresh machine): three e0 pairs of wheels 132cd36 (old) / f55f135 (new: the eager
# hot path, the written-out forward hook, the capture query without its shim), then one pair of e0 without the loop
# probe (its timers sit inside kvcanary's accounting).
T0=$SECONDS; mkdir -p .whl
RUNS="${RUNS:-e0:new e0:old e0:old e0:new e0:new e0:old e0n:old e0n:new}" TAG=2 END_S=${END_S:-585} T0=$T0 bash .e2e/ab.sh
