# Issue 25, thirteenth session, calls 3 and 4 (the machine of call 2, still warm): phases 2 and 3 with decode graphs
# and pd (new), then pd (old) and e1 (eager + token check) new / old.
RUNS="g23:new pd:new" TAG=3 END_S=430 T0=$SECONDS bash .e2e/ab.sh
RUNS="pd:old e1:new e1:old" TAG=4 END_S=205 T0=$SECONDS bash .e2e/ab.sh
