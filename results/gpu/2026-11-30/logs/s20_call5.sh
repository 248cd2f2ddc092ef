# The twentieth session's calls 1-5 (carry [".whl"]), from the repository root at 0e43d55:
#   calls 1-3: bash results/gpu/2026-11-30/logs/s19_next_call.sh grid32 | grid16 | grid64   (logs s20_call{1,2,3}_*)
#   call 4:    the commands below with s20_csr_lut_probe.py before its ELL kernel was added (s20_call4_csr_probe.txt)
#   call 5:    the commands below                                                       (s20_call5_ell_probe.txt)
# Call 6 is s20_call6.sh.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
p=results/gpu/2026-11-30/logs/s20_csr_lut_probe.py
{ python3 $p --check; python3 $p --rows 1 --slots 6555 --context 32768; python3 $p --rows 1 --slots 13108 --context 65536
  python3 $p --rows 32 --slots 3277 --context 16384; } 2>&1 | grep -v -i warn | tee $OUT/s20_call5_ell_probe.txt
