#!/usr/bin/env bash
# The steps a GPU session runs, from the repository root, on a machine whose image has torch, triton,
# transformers, pandas, pyarrow, ... (scripts/gpu_image_packages.txt) and whose other kvbench dependencies travel
# as wheels in .whl/ (made here by `python scripts/gpu_wheels.py`; carry: [".whl"]):
#   s=scripts/gpu_session.sh
#   bash $s setup; bash $s tests [pytest paths] (a call of its own); bash $s kernels-slow; bash $s e2e; bash $s decode --methods A,B ...; bash $s steps; bash $s sweep; bash $s points --methods A,B ...
#   bash $s grid --models M --methods A,B --lengths 32768 ...; bash $s targets NAME 32768 full,ems 130
#   bash $s ab OLD_DIR scripts/profile_points.py ARGS; bash $s pack
# Every step appends to $OUT/session.log; `pack` tars $GPU_WORK (all outputs) into $OUT/gpu.tar.gz.
# GPU_SITE (default /tmp/site: the installed wheels), GPU_WORK (default /tmp/gpu: outputs) and
# KVBENCH_KERNEL_TESTS (default cuda) let a machine without a GPU rehearse the steps.
set -u
step=$1
shift
work=${GPU_WORK:-/tmp/gpu}
site=${GPU_SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 PYTHONPATH=$site:$PWD
mkdir -p $work
exec > >(tee -a $OUT/session.log) 2>&1
echo "== $step $* ($(date -u +%T))"

case $step in
setup)  # every wheel in .whl/, then the versions, and the wheels' requirements and every kvbench module checked
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site .whl/*.whl || exit 1
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import sys,torch,triton,transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)"
    python3 scripts/gpu_wheels.py --check $site; echo "setup check rc=$?"; } > $work/env.txt 2>&1
  cat $work/env.txt ;;
tests)  # the fast suite with the CUDA tests on (Triton kernels compiled against the torch references, CUDA graphs
        # against eager steps, no sync in a step): two calls of their own, since it runs past 540 s on an H200
        # host (2026-11-29: 71 % in 540 s), each with its half as pytest arguments:
        #   bash $s tests tests/kernels tests/methods tests/prefill tests/report
        #   bash $s tests tests/tasks tests/test_*.py
        # One line per test, so a run stopped by the limit still names its failures. Keep each folder's paths together:
        # the image's pytest 9.1.1 drops tests/kernels/conftest.py's fixtures (the GPU model, the CUDA default device)
        # for a kernels file listed after a file of another folder (pytest-dev/pytest#14964, fixed in 9.2; seen here
        # 2026-11-30, results/gpu/2026-11-30/logs/s23_call7_order.txt)
  export KVBENCH_KERNEL_TESTS=${KVBENCH_KERNEL_TESTS:-cuda}
  timeout 540 python3 -m pytest -v -p no:cacheprovider -p tests.report_failures_now -rs --junitxml=$OUT/tests.xml "$@" > $OUT/tests.log 2>&1
  echo "fast suite (KVBENCH_KERNEL_TESTS=$KVBENCH_KERNEL_TESTS) rc=$?"; grep -E "(FAILED|ERROR)|passed|failed" $OUT/tests.log ;;
kernels-slow)  # the slow kernel tests (every method on both backends)
  export KVBENCH_KERNEL_TESTS=${KVBENCH_KERNEL_TESTS:-cuda}
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rs -m slow tests/kernels --junitxml=$work/kernel_slow.xml \
    > $work/kernel_slow.log 2>&1
  echo "slow kernel tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $work/kernel_slow.log ;;
e2e)    # tasks end to end on a GPU model (default llama3.1-8b-shape-random): NIAH, LongBench on its bundled samples,
        # a 2-point -m sweep (passkey), status and the report; one log per run
  model=${1:-llama3.1-8b-shape-random}
  root=$work/e2e
  run() {  # name, then kvbench arguments
    local name=$1; shift
    timeout 180 python3 -m kvbench "$@" results_root=$root > $work/e2e_$name.log 2>&1
    echo "$name rc=$? $(grep -cE '^│' $work/e2e_$name.log) table rows"; grep -E "Error|kvbench sweep" $work/e2e_$name.log
  }
  run niah model=$model method=snapkv budget=0.2 task=niah
  run longbench model=$model method=pyramidkv budget=0.2 task=longbench task.source=sample
  run sweep -m model=$model method=full,h2o budget=0.2 task=passkey
  python3 -c 'import sys; from kvbench.cli import status; sys.exit(status(sys.argv[1:]))' $root
  python3 -m kvbench.report --root $root --out $work/e2e_report 2>&1 | tail -2 ;;
bench)  # kernel timings, torch vs Triton
  timeout 150 python3 -m kvbench.bench kernels --device cuda --head-dim 128 --repeats 5 --max-seconds 2 --out $work/bench \
    2>&1 | tail -40 ;;
decode)  # the decode loop: in-run TPOT of ragged batches vs batch 1, the host gap, points in one step
  timeout 560 python3 -m scripts.bench_decode_loop "$@" 2>&1 | tee $work/decode_loop.md | grep -vE "^Loading" ;;
sweep)  # fused sweeps (issue 22), one process: the 6-point sweep alone and fused, the 36-point sweep fused
        # (cold, then warm), batch-1 TPOT; NIAH 16k, 8 depths, 30 new tokens, batch 8 (model: the first argument). The runs' own
        # output goes to bench_sweep_runs.log
  timeout 530 python3 -m scripts.bench_sweep --tpot \
    --wide "method=full,streamingllm,h2o,snapkv,pyramidkv,tova,cam,d2o,kvmerger,ems,weightedkv,chelsea budget=0.2,0.35,0.5" \
    model=${1:-llama3.1-8b-shape-random} task=niah 'task.context_lengths=[16000]' \
    'task.depths=[0,14,29,43,57,71,86,100]' batch_size=8 method=full,streamingllm,snapkv,tova,h2o,chelsea budget=0.2 \
    2> $work/bench_sweep_runs.log | tee $work/bench_sweep.md
  echo "bench_sweep rc=${PIPESTATUS[0]}"; grep -E "Error|error:" $work/bench_sweep_runs.log | tail -5 ;;
prefill)  # every method's prompt compression on one Llama-3.1-8B-shaped layer beside the layer (16k, 32k)
  timeout 240 python3 scripts/bench_prefill.py --profile "$@" > $work/bench_prefill.log 2>&1
  echo "bench_prefill rc=$?"; grep -E "^\|" $work/bench_prefill.log ;;
steps)  # the merging methods' decode step of one layer (Llama-3.1-8B shape: 8 KV heads, d 128), graph-replayed
  for batch in 1 64; do
    timeout 120 python3 -m kvbench.bench kernels --device cuda --ops cam_step,d2o_step,weightedkv_step,ems_step \
      --lengths 3277,6554 --batch $batch --kv-heads 8 --head-dim 128 --repeats 5 --out $work/steps_b$batch \
      2>&1 | tail -24
  done ;;
grid)   # scripts/efficiency_grid.py arguments follow (--root defaults to $work/eff)
  python3 scripts/efficiency_grid.py --root $work/eff "$@" 2>&1 | grep -E "GRID|Error" ;;
targets)  # one efficiency grid at the Llama-3.1-8B shape and its targets table: NAME LENGTH METHODS LIMIT_S (the
          # grid stops starting runs 20 s before the limit); the grid's log and table at $OUT/NAME.log and .md
  name=$1 length=$2 methods=$3 limit=$4
  timeout $limit python3 scripts/efficiency_grid.py --root $work/$name --models llama3.1-8b-shape-random \
    --methods $methods --repeats 2 --warmup 1 --lengths $length --limit-s 150 --deadline-s $((limit - 20)) \
    --new-tokens 64 > $OUT/$name.log 2>&1
  python3 scripts/efficiency_targets.py --root $work/$name --profile gpu --out $OUT/$name.md > /dev/null 2>&1
  grep -E "TPOT|TTFT" $OUT/$name.md ;;
points)  # the kernels of a fused sweep's replayed decode step (scripts/profile_points.py arguments follow)
  timeout 420 python3 -m scripts.profile_points "$@" 2>&1 | grep -vE "^(Loading|USDT)" | tee $work/points.md ;;
ab)     # one script run with an old copy of kvbench, then with this checkout, each a process of its own. OLD_DIR (the
        # first argument, carried) holds that copy's kvbench/ and conf/ (here: git archive REV kvbench conf | tar -x
        # -C OLD_DIR); the script runs by its path, since `python3 -m` would import this checkout's kvbench for both
        # (the profilers print which one they imported); the rest is the script and its arguments
  old=$1
  shift
  for version in old new; do
    if [ $version = old ]; then path=$site:$PWD/$old:$PWD; else path=$site:$PWD; fi
    echo "== $version"
    PYTHONPATH=$path timeout 250 python3 "$@" 2>&1 | grep -vE "^(Loading|USDT)"
  done ;;
pack)
  tar czf $OUT/gpu.tar.gz -C $(dirname $work) $(basename $work); ls -la $OUT ;;
*)
  echo "unknown step '$step'; accepted: setup, tests, kernels-slow, e2e, bench, decode, sweep, prefill, steps, points, grid, ab, targets, pack"; exit 2 ;;
esac
