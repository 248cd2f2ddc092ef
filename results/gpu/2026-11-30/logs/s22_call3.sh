# Twenty-second session, call 3 (carry [".whl"]): replayed 32k steps (graphs + compile) against the side lanes'
# best-match grids (triton_slots.PROGRAMS_PER_SM: 8 committed, 2, 1) and EMS's member-sum blocks (1,024 committed,
# 256), one process per method, interleaved rounds (s22_step_knobs.py); full is the noise reference.
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
K=results/gpu/2026-11-30/logs/s22_step_knobs.py
timeout 200 python3 $K --methods ems --rounds 3 --set slots.PROGRAMS_PER_SM=8,2,1 --set lut.MEMBER_BLOCK=1024,256 \
  2>&1 | grep -v -i warn | tee $OUT/s22_call3_knobs_ems.txt
timeout 150 python3 $K --methods full,d2o --rounds 3 --set slots.PROGRAMS_PER_SM=8,2,1 \
  2>&1 | grep -v -i warn | tee $OUT/s22_call3_knobs_full_d2o.txt
