# Twenty-third session, call 2 (carry [".whl"]; the machine of call 1): the 64k and 32k grids (full, EMS) with the
# values launch's single barrier.
s=scripts/gpu_session.sh; bash $s setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
bash $s targets s23_call2_eff64 65536 full,ems 170
bash $s targets s23_call2_eff32 32768 full,ems 140
