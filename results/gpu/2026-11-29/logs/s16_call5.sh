# s16 call 5: replayed steps at 32k with 2, 4 and 32 layer lanes (engine.LAYER_STREAMS), one process each
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
for n in 2 4 32; do echo "== lanes $n"
  timeout 150 python3 -c "
import sys, runpy; import kvbench.engine as e; e.LAYER_STREAMS = $n
sys.argv = ['profile_decode.py'] + sys.argv[1:]; runpy.run_path('scripts/profile_decode.py', run_name='__main__')" \
    --methods full,ems,d2o --length 32768 --modes graphs --top 0 --gaps 3 > $OUT/lanes_$n.txt 2>&1
  grep -E "timeline|graphs  " $OUT/lanes_$n.txt; done
