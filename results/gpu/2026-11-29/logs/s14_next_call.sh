# The next session's first GPU call (one `run`, carry [".whl"], under 600 s), from the repository root at main:
# the full CUDA suite, which has not run since the engine's in-place path changed (`cf1c9fb`, observe_and_evict_one);
# s14 ran only its engine, decode-path, golden, fused-sweep, method-backend and CUDA-decode parts (234 passed). It
# also checks, on the host's AVX-512 Xeon, that tests/conftest.py's AVX2 pinning makes the golden tokens hold there
# (s14 call 5 held them with the two variables set in the environment, not through the conftest).
s=scripts/gpu_session.sh
bash $s setup > /dev/null 2>&1
python3 -c "import torch; print('cpu capability before the conftest', torch.backends.cpu.get_cpu_capability())"
bash $s tests
grep -E "test_golden_tokens.*(PASSED|FAILED)" $OUT/tests.log | sort | uniq -c | tail -3
