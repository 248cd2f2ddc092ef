"""``scripts/bench_ems_kernels.py``'s tile overrides (``--set MODULE.NAME=V1,V2``): parsed, or refused with the
bad part and the accepted ones named, before any GPU work."""

from __future__ import annotations

import argparse

import pytest

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
