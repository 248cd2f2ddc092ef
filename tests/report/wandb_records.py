"""Read a W&B offline run file (``run-<id>.wandb``) back into protobuf records, for tests.

wandb 0.31 writes the run with its Go core and ships no Python reader. The file is a 7-byte header
(``:W&B``, magic 0xBEE1 little-endian, version 0) followed by a LevelDB-style log: 32 KiB blocks of chunks,
each with a 7-byte header (CRC32C: 4, payload length: 2 LE, type: 1 = full, 2 = first, 3 = middle,
4 = last); a block tail shorter than a header is zero padding. Payloads are ``wandb_internal_pb2.Record``."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest

# wandb is not carried to the GPU machine (scripts/gpu_wheels.py): only logger=wandb needs it there
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="logger=wandb needs wandb")

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, "not a W&B run file"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # block trailer padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def decode_run(path: Path) -> dict:
    """Summary values, config values, history rows, group, tags and project decoded from a run file."""
    summary, config, history, run = {}, {}, [], {}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"group": record.run.run_group, "tags": list(record.run.tags), "project": record.run.project,
                   "name": record.run.display_name}
            for item in record.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return {**run, "summary": summary, "config": config, "history": history}
