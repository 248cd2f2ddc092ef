"""``scripts/bench_ems_kernels.py``'s tile overrides (``--set MODULE.NAME=V1,V2``): parsed, or refused with the
bad part and the accepted ones named, before any GPU work."""

from __future__ import annotations

import argparse

import pytest
import torch

from scripts import bench_ems_kernels


def parse(*items: str):
    return bench_ems_kernels.parse_overrides(list(items), argparse.ArgumentParser(prog="bench_ems_kernels"))


def test_overrides_parse_integers_and_tuples():
    assert parse("d2o.STREAMED_TILE=32:4,32:8", "decode.WAVES=2") == [
        (("d2o", "STREAMED_TILE"), [(32, 4), (32, 8)]), (("decode", "WAVES"), [2])]


@pytest.mark.parametrize("item, named, accepted", [
    ("triton_d2o_step.STREAMED_TILE=32:8", "'triton_d2o_step'", "d2o"),
    ("d2o.STREAMED_TILES=32:8", "'STREAMED_TILES'", "STREAMED_TILE"),
    ("d2o.STREAMED_TILE=32x8", "'32x8'", "64:4:3"),
])
def test_bad_overrides_name_the_bad_part_and_the_accepted(item, named, accepted, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse(item)
    assert stopped.value.code == 2
    message = capsys.readouterr().err
    assert named in message and accepted in message


def test_hot_share_puts_that_share_of_members_on_the_first_slot():
    """``--hot-share``: the share of the table's members whose centre is the row's first slot, as a sink that
    gathers merges would have them (the look-up-table attention's atomics and buckets under contention)."""
    args = argparse.Namespace(rows=2, kv_heads=2, slots=65, context=500, gamma=4.0, table_fill=0.9, group=2,
                              head_dim=16, hot_share=0.5)
    on_first = (bench_ems_kernels.layer(args, torch.device("cpu"))["member_slot"] == 0).float().mean().item()
    args.hot_share = 0.0
    spread = (bench_ems_kernels.layer(args, torch.device("cpu"))["member_slot"] == 0).float().mean().item()
    assert 0.45 < on_first < 0.55 and spread < 0.05


def test_bad_hot_share_is_refused_before_any_gpu_work(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_ems_kernels", "--hot-share", "1.5"])
    with pytest.raises(SystemExit) as stopped:
        bench_ems_kernels.main()
    assert stopped.value.code == 2 and "--hot-share 1.5" in capsys.readouterr().err
