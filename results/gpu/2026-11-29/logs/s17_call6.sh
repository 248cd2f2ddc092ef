# s17 call 6: the 32k grid, full and D2O, at 622b7f1 (old: s17_old = git archive 622b7f1 kvbench conf) and
# with D2O's budget statistics taken in the pass (new), each a process of its own, one machine; then 64k, new
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONUNBUFFERED=1
grid() {  # version length methods
  local path=/tmp/site:$PWD; [ $1 = old ] && path=/tmp/site:$PWD/s17_old:$PWD
  # (its "kvbench from" line printed this checkout for both: `python3 -c` puts the working directory first)
  PYTHONPATH=$path python3 -c "import kvbench, os; print('$1 $2: kvbench from', os.path.dirname(kvbench.__file__))"
  PYTHONPATH=$path timeout 230 python3 scripts/efficiency_grid.py --root /tmp/gpu/eff_$1_$2 \
    --models llama3.1-8b-shape-random --methods $3 --repeats 2 --warmup 1 --lengths $2 --new-tokens 64 \
    --limit-s 200 > $OUT/grid_$1_$2.log 2>&1
  PYTHONPATH=/tmp/site:$PWD python3 scripts/efficiency_targets.py --root /tmp/gpu/eff_$1_$2 --profile gpu \
    --out $OUT/targets_$1_$2.md > /dev/null 2>&1
  grep -E "d2o|full" $OUT/targets_$1_$2.md
}
grid old 32768 full,d2o
grid new 32768 full,d2o
grid new 65536 full,d2o
