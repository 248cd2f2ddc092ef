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
import runpy
import sys

import torch

import kvbench.engine as engine


def green_streams(sms: int):
    from torch.cuda import green_contexts

    contexts = {}

    def side_streams(device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in contexts:
            create = getattr(green_contexts.GreenContext, "create")
            contexts[index] = create(num_sms=sms, device_id=index)
        context = contexts[index]
        if not hasattr(context, "Stream"):
            raise RuntimeError(f"torch {torch.__version__}: GreenContext has no Stream()")
        return tuple(context.Stream() for _ in range(count))

    return side_streams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sms", type=int, default=0)
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    if args.sms:
        try:
            streams = green_streams(args.sms)(torch.device("cuda"), 2)
            print(f"green lanes: {args.sms} multiprocessors, streams {[s.cuda_stream for s in streams]}", flush=True)
        except Exception as err:  # noqa: BLE001 - the probe's answer
            print(f"green lanes unavailable: {err!r}", flush=True)
            return
        engine._side_streams = green_streams(args.sms)
    sys.argv = ["profile_decode.py", *rest]
    runpy.run_path("scripts/profile_decode.py", run_name="__main__")


if __name__ == "__main__":
    main()
