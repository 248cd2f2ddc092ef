"""What the device allows: its memory bandwidth (a copy probe), the bytes-read bound on decode time, and work
run under a memory cap with an out-of-memory returned as a result instead of raised."""

from __future__ import annotations

import gc
import multiprocessing
import resource
import signal
import time
import traceback
from collections.abc import Callable

import psutil
import torch

from kvbench.engine import _sync

# what allocators say when they run out (CPU allocator, Python, CUDA caching allocator, cuBLAS workspace,
# a thread stack under the address-space cap)
OUT_OF_MEMORY_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory", "ALLOC_FAILED",
                          "can't start new thread")
# bytes copied by the bandwidth probe: well past every cache level, small beside the device's memory
COPY_PROBE_BYTES = {"cuda": 2**30, "cpu": 2**28}


def parameter_bytes_read(model, batch: int) -> int:
    """Weight bytes one decode step of ``batch`` rows reads: every parameter once (a tied embedding once, read
    whole by the LM head); an input embedding not tied to the LM head contributes only the looked-up rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared parameters counted once
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != embedding.data_ptr():
        row_bytes = embedding.shape[1] * embedding.element_size()
        total -= embedding.shape[0] * row_bytes - batch * row_bytes
    return total


def tpot_bound_seconds(parameter_bytes: float, kv_bytes: float, bandwidth: float) -> float:
    """The least time a decode step can take on a device that moves ``bandwidth`` bytes per second."""
    return (parameter_bytes + kv_bytes) / bandwidth


def copy_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy (bytes read + bytes written), best of ``repeats`` after a
    warm-up copy that also faults the pages in."""
    n = COPY_PROBE_BYTES["cuda" if device.type == "cuda" else "cpu"] // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * 4 * n / best


# -- running under a memory cap ---------------------------------------------------------------------------


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def memory_limit(device: torch.device, cap_bytes: int) -> float | None:
    """The peak memory (as ``PeakMemory`` reports it) at which a capped try runs out, where that is known:
    CUDA, what the process reserves now plus the cap; CPU, None (the address-space cap has slack, see
    ``MemoryCap``, and tensor peaks are not what it counts)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device) + cap_bytes


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(err, RuntimeError) and any(m in str(err) for m in OUT_OF_MEMORY_MESSAGES))


def first_line(err: BaseException) -> str:
    """The error's type and the first line of its message (a C++ ``std::bad_alloc`` says only that)."""
    return f"{type(err).__name__}: " + (str(err).strip().splitlines() or [""])[0]


class MemoryCap:
    """``with MemoryCap(device, cap_bytes) as capped: result = capped.run(work)``: ``work()`` may allocate
    ``cap_bytes`` beyond what the process holds at the ``with``; ``run`` returns ``work()``'s dict, or the
    first line of the out-of-memory error as a string. Any other error is raised.

    CUDA: the caching allocator's limit (``set_per_process_memory_fraction``) is set to the memory reserved
    now plus the cap, and restored on exit. CPU: ``work`` runs in a forked child (which shares the model)
    whose address space is capped (RLIMIT_AS) at its size plus the cap, so the allocator really fails; the
    result comes back through a pipe. Address space the process had already mapped and left unused (an
    allocator arena's free or reserved part, typically tens of MB) is reused on top of the cap, so on CPU a
    batch's resident peak can exceed a small cap. A child killed by a signal (the kernel's OOM killer) is an
    out-of-memory too.
    """

    def __init__(self, device: torch.device, cap_bytes: int) -> None:
        self.device = device
        self.cap_bytes = cap_bytes

    def __enter__(self) -> "MemoryCap":
        if self.device.type == "cuda":
            self._previous = torch.cuda.get_per_process_memory_fraction(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            limit = memory_limit(self.device, self.cap_bytes)
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(self._previous, self.device)

    def run(self, work: Callable[[], dict]) -> dict | str:
        if self.device.type != "cuda":
            return self._run_in_child(work)
        try:
            return work()
        except RuntimeError as err:
            if not is_out_of_memory(err):
                raise
            message = first_line(err)
        # the exception (and the frames holding the try's tensors) is gone here: free them
        gc.collect()
        torch.cuda.empty_cache()
        return message

    def _run_in_child(self, work: Callable[[], dict]) -> dict | str:
        context = multiprocessing.get_context("fork")  # the child shares the model instead of loading it
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_capped_child, args=(work, self.cap_bytes, send), daemon=True)
        child.start()
        send.close()
        try:
            kind, payload = receive.recv()
        except EOFError:
            kind, payload = None, None
        child.join()
        if kind is None and child.exitcode is not None and child.exitcode < 0:  # e.g. the kernel's OOM killer
            return f"child killed by {signal.Signals(-child.exitcode).name} under a {self.cap_bytes}-byte cap"
        if kind is None or kind == "error":
            raise RuntimeError(f"capped child process failed (exit {child.exitcode}): {payload}")
        return payload


def _capped_child(work: Callable[[], dict], cap_bytes: int, send) -> None:
    torch.set_num_threads(1)  # GNU OpenMP hangs in a forked child that uses the parent's thread pool
    limit = psutil.Process().memory_info().vms + cap_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        result = ("done", work())
    except BaseException as err:  # noqa: BLE001 - every outcome goes back to the parent
        result = ("done", first_line(err)) if is_out_of_memory(err) else ("error", traceback.format_exc())
    send.send(result)
