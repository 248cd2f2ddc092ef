"""task.source=hub through the real huggingface_hub download path, against a loopback server that serves the
hub's repository layout (tests/fake_hub.py) with small files in the real formats: LongBench's data.zip,
ZeroSCROLLS' <task>.zip, PG19's parquet shards, GSM8K's parquet files."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from kvbench.errors import ConfigError
from kvbench.tasks.sources import PACKAGE_DATA, read_records

from tests.conftest import REPO, pythonpath_with_repo
from tests.fake_hub import FakeHub

LONGBENCH, ZEROSCROLLS, PG19, GSM8K = "THUDM/LongBench", "tau/zero_scrolls", "emozilla/pg19-test", "openai/gsm8k"


def zipped(members: dict[str, Path]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, path in members.items():
            archive.writestr(name, path.read_bytes())
    return buffer.getvalue()


def parquet(records: list[dict]) -> bytes:
    buffer = io.BytesIO()
    pd.DataFrame(records).to_parquet(buffer, index=False)
    return buffer.getvalue()


def hub_repos() -> dict[str, dict[str, bytes]]:
    """The four repositories' layouts, filled with kvbench's shipped fixtures (real field layout)."""
    longbench = PACKAGE_DATA / "longbench" / "sample"
    zeroscrolls = PACKAGE_DATA / "zeroscrolls" / "sample"
    books = read_records(PACKAGE_DATA / "pg19" / "sample" / "test.jsonl")
    gsm8k = PACKAGE_DATA / "gsm8k"
    return {
        LONGBENCH: {"LongBench.py": b"# loading script", "data.zip": zipped(
            {f"data/{p.name}": p for p in longbench.glob("*.jsonl")})},
        ZEROSCROLLS: {"zero_scrolls.py": b"# loading script", **{
            f"{task.name}.zip": zipped({f"{task.name}/{p.name}": p for p in task.glob("*.jsonl")})
            for task in zeroscrolls.iterdir()}},
        PG19: {"README.md": b"pg19", "data/test-00000-of-00002.parquet": parquet(books[:3]),
               "data/test-00001-of-00002.parquet": parquet(books[3:])},
        GSM8K: {"main/test-00000-of-00001.parquet": parquet(read_records(gsm8k / "sample" / "test.jsonl")),
                "main/train-00000-of-00001.parquet": parquet(read_records(gsm8k / "train_first5.jsonl"))},
    }


TASKS = {  # the same tasks read from the hub (in a subprocess) and from the shipped fixtures
    "longbench": 'LongBench(datasets=["qasper", "trec"], source=SOURCE)',
    "longbench_e": 'LongBench(datasets=["qasper"], variant="e", source=SOURCE, revision=REV)',
    "zeroscrolls": 'ZeroScrolls(tasks=["qasper", "quality"], source=SOURCE)',
    "pg19": "PG19(source=SOURCE)",
    "gsm8k": 'LMEval(tasks=["gsm8k"], source=SOURCE)',
}
LOAD_ALL = """
import json
from kvbench.tasks.longbench import LongBench
from kvbench.tasks.zeroscrolls import ZeroScrolls
from kvbench.tasks.pg19 import PG19
from kvbench.tasks.lm_eval import LMEval
def rows(samples):
    return [{"id": s.id, "references": s.references, "context": s.context, "question": s.question,
             **{k: s.meta.get(k) for k in ("dataset_revision", "data_path", "data_source")}} for s in samples]
print(json.dumps({name: rows(eval(task).samples()) for name, task in TASKS.items()}))
"""


def from_fixtures() -> dict:
    from kvbench.tasks.lm_eval import LMEval  # noqa: F401 - names used by eval
    from kvbench.tasks.longbench import LongBench  # noqa: F401
    from kvbench.tasks.pg19 import PG19  # noqa: F401
    from kvbench.tasks.zeroscrolls import ZeroScrolls  # noqa: F401

    scope = {**locals(), "SOURCE": "sample", "REV": None}
    return {name: [(s.id, s.references, s.context, s.question) for s in eval(task, scope).samples()]
            for name, task in TASKS.items()}


def load_through(endpoint: str, home: Path, revision: str = "main") -> dict:
    """Run the tasks' hub loading in a fresh process whose huggingface_hub talks to ``endpoint``."""
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "PYTHONPATH": pythonpath_with_repo()}
    env.pop("HF_HUB_OFFLINE", None)
    script = f"SOURCE, REV, TASKS = 'hub', {revision!r}, {TASKS!r}\n{LOAD_ALL}"
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def repos():
    return hub_repos()


def test_every_hub_source_downloads_the_official_files_and_records_the_commit(repos, tmp_path):
    with FakeHub(repos) as hub:
        loaded = load_through(hub.endpoint, tmp_path / "hf", revision=hub.sha[LONGBENCH])
    hub_rows = {name: [(s["id"], s["references"], s["context"], s["question"]) for s in rows]
                for name, rows in loaded.items()}
    assert hub_rows == from_fixtures()  # PG19: both shards, in order
    for name, repo in (("longbench", LONGBENCH), ("longbench_e", LONGBENCH), ("zeroscrolls", ZEROSCROLLS),
                       ("pg19", PG19), ("gsm8k", GSM8K)):
        assert {s["dataset_revision"] for s in loaded[name]} == {hub.sha[repo]}, name
        assert {s["data_source"] for s in loaded[name]} == {"hub"}
    assert loaded["longbench"][0]["data_path"] == "data.zip::data/qasper.jsonl"
    assert loaded["zeroscrolls"][-1]["data_path"] == "quality.zip::quality/validation.jsonl"
    fetched = {path for method, path in hub.requests if method == "GET" and "/resolve/" in path}
    # data.zip once: LongBench-E asks for the commit the cache already holds, which needs no request at all
    assert fetched == {f"/datasets/{LONGBENCH}/resolve/main/data.zip",
                       f"/datasets/{ZEROSCROLLS}/resolve/main/qasper.zip",
                       f"/datasets/{ZEROSCROLLS}/resolve/main/quality.zip",
                       *(f"/datasets/{PG19}/resolve/main/data/test-0000{i}-of-00002.parquet" for i in (0, 1)),
                       f"/datasets/{GSM8K}/resolve/main/main/test-00000-of-00001.parquet",
                       f"/datasets/{GSM8K}/resolve/{hub.sha[GSM8K]}/main/train-00000-of-00001.parquet"}
    assert not any(p.endswith(".py") for _, p in hub.requests)  # no loading script is touched


def test_files_are_cached_and_read_again_without_the_server(repos, tmp_path):
    with FakeHub(repos) as hub:
        first = load_through(hub.endpoint, tmp_path / "hf")
        downloads = sum(method == "GET" and "/resolve/" in path for method, path in hub.requests)
    assert downloads == 7  # each file once: data.zip (both LongBench variants), 2 ZeroSCROLLS zips, 2+2 parquet
    dead = hub.endpoint  # the server is shut down: huggingface_hub falls back to its cache
    again = load_through(dead, tmp_path / "hf")
    assert again == first


def test_unreachable_hub_fails_with_one_line_pointing_at_local_or_sample(monkeypatch, tmp_path):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection and no cached file")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    from kvbench.tasks.longbench import LongBench

    with pytest.raises(ConfigError) as err:
        LongBench(datasets=["qasper"], source="hub").samples()
    message = str(err.value)
    assert "\n" not in message and "task.source=local task.data_dir=" in message and "task.source=sample" in message
    assert "'data.zip' of THUDM/LongBench" in message


@pytest.fixture
def dead_hub(monkeypatch, tmp_path):
    """huggingface_hub pointed at a port nothing listens on, with an empty cache."""
    import socket

    from huggingface_hub import constants

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return constants


@pytest.mark.parametrize("offline", [False, True], ids=["no connection", "HF_HUB_OFFLINE"])
def test_an_unreachable_hub_fails_at_once_without_retries(dead_hub, monkeypatch, caplog, offline):
    """Issue 24, case 8: one request tells that the hub cannot be reached; no retry loop (huggingface_hub
    retries a file 5 times, about 25 s, before looking in its cache)."""
    import logging

    from kvbench.tasks.longbench import LongBench
    from kvbench.tasks.pg19 import PG19

    monkeypatch.setattr(dead_hub, "HF_HUB_OFFLINE", offline)
    for task, file in ((LongBench(datasets=["qasper"], source="hub"), "data.zip"), (PG19(source="hub"), "data/test-*")):
        with caplog.at_level(logging.INFO), pytest.raises(ConfigError) as err:
            task.samples()
        reason = "HF_HUB_OFFLINE is set" if offline else "Connect"  # httpx: ConnectError
        assert f"could not fetch '{file}" in str(err.value) and "the hub cannot be reached" in str(err.value)
        assert reason in str(err.value) and "\n" not in str(err.value)
    assert "Retrying" not in caplog.text and "Retry" not in caplog.text
