"""Peak memory of a block of work, comparable across methods within one process.

CUDA: ``torch.cuda.max_memory_allocated`` after a reset (what tensors really held at the peak).
CPU: the peak process RSS sampled every ``interval`` seconds by a thread during the block, minus the RSS at
its start: the growth the block caused. (``ru_maxrss`` cannot be reset, so it would carry an earlier run's
peak into a later one.) Sampling can miss a spike shorter than the interval; the number is a lower bound.
"""

from __future__ import annotations

import threading

import psutil
import torch


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.bytes``."""

    def __init__(self, device: torch.device, interval: float = 0.002) -> None:
        self.device = device
        self.interval = interval
        self.bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        process = psutil.Process()
        self._start = process.memory_info().rss
        self._max = self._start

        def sample() -> None:
            while not self._stop.wait(self.interval):
                self._max = max(self._max, process.memory_info().rss)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        self._stop.set()
        self._thread.join()
        self._max = max(self._max, psutil.Process().memory_info().rss)
        self.bytes = int(self._max - self._start)
