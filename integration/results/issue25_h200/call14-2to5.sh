# Issue 25, fourteenth session, calls 2-5 (each one command on the device; ab14.sh = call14-ab.sh). New = the wheel of
# 95305fd in calls 2-4 (the source primed at start-up), 6faa9f2 in call 5 (its compaction's operations primed too);
# iss = c684c2e, the issue's own before, under its own driver. Calls 3 and 4 also ran the loop probe's new pieces
# (integration/loop_probe.py at the time: the streams helpers and torch's event calls; then garbage collections).
RUNS="g23:new pd:new e0:iss e0:new" TAG=2 END_S=560 T0=$SECONDS bash .e2e/ab14.sh   # call 2 (warm after call 1)
RUNS="e2:new e0:new e0:iss" TAG=3 END_S=330 T0=$SECONDS bash .e2e/ab14.sh           # call 3 (fresh)
RUNS="e2:new" TAG=4 END_S=150 T0=$SECONDS bash .e2e/ab14.sh                         # call 4 (warm)
RUNS="e2:new e0:new e0:iss e1:iss e1:new" TAG=5 END_S=400 T0=$SECONDS bash .e2e/ab14.sh  # call 5 (fresh)
