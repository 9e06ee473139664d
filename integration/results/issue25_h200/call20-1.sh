# Session 20, call 1 (fresh): the token mail's decode post in C (issue 25). base = f201172 (main's plugin before this
# session: a decode batch's columns built in Python, then TokenMail.post), new = this session's wheel (the host
# extension reads and posts a decode batch in one C call). e1 (eager + token check) base / new alternating, 3 pairs.
T0=$SECONDS
python3 -c "import sys,sysconfig,os; p=sysconfig.get_paths()['include']; print(sys.version.split()[0], p, 'Python.h', os.path.exists(p+'/Python.h'))"
RUNS="${RUNS:-e1:new e1:base e1:base e1:new e1:new e1:base}" TAG=1 END_S=$((${END_S:-580} - (SECONDS - T0))) bash .e2e/ab.sh
echo "total $((SECONDS - T0)) s"
