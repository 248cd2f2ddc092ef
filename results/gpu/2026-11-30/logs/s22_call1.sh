# The next session's first GPU call (carry [".whl"]), from the repository root at this commit or later with
# kvbench/kernels/triton_lut_attention.py unchanged since: EMS's look-up-table attention with its logits and member
# sums laid out (slot, query head) (s21_lut_interleaved.patch: one sector a member for its group's gathers and
# atomic adds, not four) against the committed layout, one process; launch 2's block and warps swept; the prompt
# compress of EMS and D2O at 32k over the best-match kernel's tiles (s21_best_match_tiles.py); the 32k grid. About 400 s.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
L=results/gpu/2026-11-30/logs
mkdir -p ab && cp kvbench/kernels/triton_lut_attention.py ab/old_triton_lut_attention.py
patch -s -o ab/interleaved_triton_lut_attention.py kvbench/kernels/triton_lut_attention.py < $L/s21_lut_interleaved.patch
for shape in "1 6555 32768" "1 13108 65536" "32 3277 16384"; do set -- $shape
  timeout 80 python3 $L/s21_lut_ab.py --rows $1 --slots $2 --context $3 --variants interleaved \
    --base-label "committed" --new-label "working tree"
done 2>&1 | grep -v -i warn | tee $OUT/s22_lut_interleaved.txt
for shape in "1 6555 32768" "1 13108 65536"; do set -- $shape
  timeout 90 python3 -m scripts.bench_ems_kernels --only lut_attention --rows $1 --slots $2 --context $3 \
    --set lut.MEMBER_BLOCK=256,512,1024 --set lut.MEMBER_WARPS=4,8
done 2>&1 | grep -v -i warn | tee $OUT/s22_lut_member_block.txt
timeout 120 python3 $L/s21_best_match_tiles.py 2>&1 | grep -v -i warn | tee $OUT/s22_best_match_tiles.txt
bash $s targets s22_eff32 32768 full,ems 130
