"""Peak memory of a block of work: the bytes of live tensors at their peak, on CUDA and on the CPU alike.

CUDA: ``torch.cuda.max_memory_allocated`` after a reset: every live tensor's bytes (the weights included)
at the block's peak.
CPU: the same count, from the CPU allocator's own reports: the torch profiler (``profile_memory``) records
every allocation and free with its size, so the running sum of those records is the bytes of tensors the
block allocated and still holds, and its maximum is the block's peak growth. ``PeakMemory`` adds
``baseline`` (the bytes the caller knows are live at the start: the model's weights) so that the CPU number
means what the CUDA one means. RSS would not: the allocator reuses memory an earlier run freed without
growing the process, and keeps freed memory mapped. The profiler records the allocator's reports only, not
every operator (``_AllocationsProfiler``): with operators it more than doubled a CPU quality run's wall (SmolLM2,
4 fused NIAH points: 49 s against 21 s unprofiled; allocations only: 28 s), most of it spent building the
events when the block ends. Its cost is alike for every system a benchmark compares; blocks must not nest
(one profiler at a time).
"""

from __future__ import annotations

import gc

import torch
from torch.profiler import ProfilerActivity, profile

MEMORY_RECORD = "[memory]"  # the profiler's name for an allocator report (bytes > 0: allocation, < 0: free)


def peak_growth(records) -> int:
    """Peak of the running sum of allocator reports (profiler events), in time order: bytes."""
    running = peak = 0
    for record in sorted(records, key=lambda r: r.start_ns()):
        running += record.nbytes()
        peak = max(peak, running)
    return peak


class PeakMemory:
    """``with PeakMemory(device, baseline) as peak: ...`` then ``peak.bytes`` (live tensor bytes at the peak).

    ``baseline``: on the CPU, the bytes of tensors live at the start that the block's peak includes (CUDA
    counts them itself)."""

    def __init__(self, device: torch.device, baseline: int = 0) -> None:
        self.device = device
        self.baseline = baseline
        self.bytes = 0
        self._profiler: _AllocationsProfiler | _PublicProfiler | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        try:
            self._profiler = _AllocationsProfiler().__enter__()
        except (ImportError, AttributeError, TypeError, RuntimeError):
            self._profiler = _PublicProfiler(activities=[ProfilerActivity.CPU], profile_memory=True).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        self._profiler.__exit__(*exc)
        records = (e for e in self._profiler.events() if e.name() == MEMORY_RECORD)
        self.bytes = self.baseline + peak_growth(records)
        self._profiler = None


class _AllocationsProfiler:
    """The torch profiler recording allocator reports but no operator: its record-function callbacks are
    limited to user scopes (``record_function`` blocks), which cover no operator. Private torch API: where it
    is missing or changed, ``PeakMemory`` takes the public profiler (the same reports, every operator too)."""

    def __enter__(self) -> "_AllocationsProfiler":
        from torch._C import _autograd, _profiler

        config = _profiler.ProfilerConfig(_profiler.ProfilerState.KINETO, False, True, False, False, False,
                                          _profiler._ExperimentalConfig())  # shapes, memory, stack, flops, modules
        activities = {_profiler.ProfilerActivity.CPU}
        _autograd._prepare_profiler(config, activities)
        _autograd._enable_profiler(config, activities, {_profiler.RecordScope.USER_SCOPE})
        self._disable = _autograd._disable_profiler
        return self

    def __exit__(self, *exc) -> None:
        self.result = self._disable()

    def events(self):
        return self.result.events()


class _PublicProfiler(profile):
    def events(self):
        return self.profiler.kineto_results.events()


def release_memory() -> None:
    """Free what dropped objects still hold: reference cycles (an exception's frames keep a failed run's model
    and caches) collected, then the CUDA allocator's cached blocks returned, so the next run loads into free
    memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
