# s17 call 3: replayed 32k steps with the side kernels' grids narrowed (triton_slots.PROGRAMS_PER_SM 8, 2, 1),
# one process each: a lane's wide grid takes every multiprocessor for its duration, so the step's next kernel waits
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
for n in 8 2 1; do echo "== programs per SM $n"
  timeout 130 python3 -c "
import sys, runpy; import kvbench.kernels.triton_slots as s; s.PROGRAMS_PER_SM = $n
sys.argv = ['profile_decode.py'] + sys.argv[1:]; runpy.run_path('scripts/profile_decode.py', run_name='__main__')" \
    --methods full,ems,d2o --length 32768 --modes graphs --top 8 > $OUT/pps_$n.txt 2>&1
  grep -E "graphs: |_redundancy|_merge_kernel|_lut_kernel|timeline" $OUT/pps_$n.txt; done
