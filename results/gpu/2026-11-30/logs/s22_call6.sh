# Twenty-second session, call 6 (carry [".whl"]): whether EMS's and H2O's 32k prompt passes wait for the host
# (profile_shared_pass: wall, device busy and idle, host waits; then the sites that synchronise).
bash scripts/gpu_session.sh setup >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
for m in full h2o ems d2o; do
  timeout 100 python3 -m scripts.profile_shared_pass --methods $m --budgets 0.2 --length 32768 --repeats 2 --top 12
done 2>&1 | grep -v -i warn | tee $OUT/s22_call6_prefill_profile.txt | grep -E "^==|host calls|threads busy|runtime calls"
timeout 80 python3 -m scripts.profile_shared_pass --methods ems --budgets 0.2 --length 32768 --repeats 1 --sync-sites \
  2>&1 | grep -v -i warn | tee $OUT/s22_call6_ems_sync_sites.txt | tail -14
