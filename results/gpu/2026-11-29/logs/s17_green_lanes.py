"""Do EMS's side lanes slow its replayed step less when they may use only some multiprocessors? Each lane of
``engine.LayerLanes`` becomes a stream of a CUDA green context of ``--sms`` multiprocessors (of 132 on an H200), so a
lane's wide launches (EMS's redundancy: every multiprocessor, about 3x its own time beside the step's GEMMs, s17 call 3)
leave the rest to the step; then ``profile_decode``'s graph mode, full and EMS at 32k. ``--sms 0``: the committed
lanes. Prints why, where this torch or driver has no green-context streams or a capture refuses them.

    PYTHONPATH=/tmp/site:$PWD python3 results/gpu/2026-11-29/logs/s17_green_lanes.py --sms 32 -- \
        --methods full,ems --length 32768 --modes graphs --top 6
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys

import torch

import kvbench.engine as engine


def _driver_green_stream_factory(sms: int, index: int):
    """Streams of a green context of ``sms`` multiprocessors made through the CUDA driver's own calls
    (cuda-bindings), for a torch whose ``GreenContext`` makes no streams: cuDevSmResourceSplitByCount,
    cuDevResourceGenerateDesc, cuGreenCtxCreate, then cuGreenCtxStreamCreate, wrapped as torch external streams."""
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver

    def check(result):
        err, *values = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver error {err}")
        return values[0] if len(values) == 1 else values

    torch.cuda.init()
    device = check(driver.cuDeviceGet(index))
    whole = check(driver.cuDeviceGetDevResource(device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, count, _ = check(driver.cuDevSmResourceSplitByCount(1, whole, 0, sms))
    if count != 1:
        raise RuntimeError(f"split into {count} groups")
    desc = check(driver.cuDevResourceGenerateDesc([groups[0]], 1))
    green = check(driver.cuGreenCtxCreate(desc, device, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    print(f"green context through the driver: {groups[0].sm.smCount} multiprocessors", flush=True)

    def stream() -> torch.cuda.Stream:
        handle = check(driver.cuGreenCtxStreamCreate(green, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", index))

    return stream


def green_streams(sms: int):
    factories = {}

    @functools.cache  # as engine._side_streams: one set of lanes for the process, not new streams every pass
    def side_streams(device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in factories:
            from torch.cuda import green_contexts

            context = green_contexts.GreenContext.create(num_sms=sms, device_id=index)
            factories[index] = context.Stream if hasattr(context, "Stream") else _driver_green_stream_factory(
                sms, index)
        return tuple(factories[index]() for _ in range(count))

    return side_streams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sms", type=int, default=0)
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.sms:
        side_streams = green_streams(args.sms)
        try:
            streams = side_streams(torch.device("cuda", torch.cuda.current_device()), 2)
            print(f"green lanes: {args.sms} multiprocessors, streams {[s.cuda_stream for s in streams]}", flush=True)
        except Exception as err:  # noqa: BLE001 - the probe's answer
            print(f"green lanes unavailable: {err!r}", flush=True)
            return
        engine._side_streams = side_streams
    sys.argv = ["profile_decode.py", *rest]
    runpy.run_path("scripts/profile_decode.py", run_name="__main__")


if __name__ == "__main__":
    main()
