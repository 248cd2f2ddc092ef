"""A prompt pass's per-layer compressions overlapped with the pass itself (``kvbench.shared_prefill``).

A fused sweep compresses every layer of a prompt for a dozen points as soon as the pass leaves the layer. Those
compressions are many small kernels and host decisions; a read back (``Tensor.cpu``), where one is left (the host
knows most sizes: ``kv.HostSizes``), waits for everything queued before it. Run in line, the device idles while the
host plans a compression and the host idles while the device runs the next layer: the two add up. ``LayerWorker``
takes each layer's compression to a host thread: the pass's thread goes on launching the next layers while the
worker compresses, so the device has work queued while either thread plans.

Both threads launch on the pass's stream. A compression's kernels are queued after the layer it reads (it is
submitted once that layer's attention is queued), the pass uses the worker's results only after ``close``, and
memory freed by either thread is handed out again only to work queued after it on the same stream: the order
a single stream gives is all the synchronisation there is, and one allocator pool serves both threads (a stream
of the worker's own measured no faster and kept the compressed rows in a pool the decode step's storage and
graph could not use: a 36-point sweep ran out of memory). Each compression is the same kernels on the same
tensors as in line: what a point keeps does not change.

Memory stays bounded: at most ``DEPTH`` layers wait for the worker (the pass's thread blocks on a full queue), so a
pass holds at most ``DEPTH + 2`` uncompressed layers instead of one (those waiting, the one being compressed and
the one just computed).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from contextlib import ExitStack

import torch

from kvbench.kv import AttentionStats, LayerKV

DEPTH = 2  # layers that may wait for the worker before the pass's thread waits for it


class LayerWorker:
    """Runs ``compress(layer, kv, stats)`` for every ``submit``-ted layer, in order, on a host thread that launches
    on the creating thread's current stream. ``close`` waits for all of them and re-raises what the worker
    raised; a failed layer's successors are skipped."""

    def __init__(self, compress: Callable[[int, LayerKV, list[AttentionStats]], None], device: torch.device) -> None:
        self.compress, self.device = compress, device
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None  # thread-local: passed on
        self.queue: queue.Queue = queue.Queue(maxsize=DEPTH)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kvbench-compress", daemon=True)
        self.thread.start()

    def submit(self, layer: int, kv: LayerKV, stats: list[AttentionStats]) -> None:
        """Queue layer ``layer``'s compression (its kernels go after what the stream holds now)."""
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())  # thread-local: the worker takes them
        self.queue.put((layer, kv, stats, modes))

    def close(self) -> None:
        """Wait for every queued compression."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        with ExitStack() as scope:
            if self.stream is not None:
                scope.enter_context(torch.cuda.device(self.device))
                scope.enter_context(torch.cuda.stream(self.stream))
            while (item := self.queue.get()) is not None:
                layer, kv, stats, (inference, grad) = item
                del item  # the layer's tensors go when its compression is done
                if self.error is not None:
                    continue
                try:
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                        self.compress(layer, kv, stats)
                except BaseException as err:  # noqa: BLE001 - handed to the pass's thread in close
                    self.error = err
                del kv, stats
