"""Where benchmark records come from: ``task.source=hub|local|sample``.

* ``hub``: ``datasets.load_dataset(hub_id, config, split=..., revision=...)`` (needs the network);
* ``local``: the same records as files under ``task.data_dir`` (jsonl, json or parquet; see each task for
  the file names it looks for), for machines without the hub;
* ``sample``: the small fixtures shipped in ``kvbench/data/<benchmark>/sample`` (real field layout,
  synthetic short texts; scores on them mean nothing).

Every record set comes with its provenance (source, dataset id, config, revision or file), which tasks copy
into ``Sample.meta`` so it lands in every result row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import ConfigError, unknown_name

SOURCES = ("hub", "local", "sample")
PACKAGE_DATA = Path(__file__).resolve().parent.parent / "data"


@dataclass(frozen=True)
class DataRef:
    """One record set: a hub dataset config+split, and the file names it has in a local/sample directory."""

    hub_id: str
    config: str
    split: str
    files: tuple[str, ...]  # relative paths tried in order under data_dir / the sample directory


def check_source(source: str, data_dir: str | None) -> None:
    if source not in SOURCES:
        raise unknown_name("task.source", source, SOURCES)
    if source == "local" and not data_dir:
        raise ConfigError("task.source=local needs task.data_dir=DIR (a folder with the benchmark's files)")


def load_records(ref: DataRef, source: str, data_dir: str | None, revision: str | None,
                 sample_dir: Path) -> tuple[list[dict], dict]:
    """Records (dicts with the benchmark's own field names) and their provenance."""
    check_source(source, data_dir)
    if source == "hub":
        return _from_hub(ref, revision)
    folder = Path(data_dir) if source == "local" else sample_dir
    path = next((folder / name for name in ref.files if (folder / name).is_file()), None)
    if path is None:
        hint = "" if source == "local" else " (no shipped fixture for it)"
        raise ConfigError(f"{ref.hub_id} '{ref.config}' ({ref.split}): none of {list(ref.files)} found in "
                          f"{folder}{hint}")
    provenance = {"data_source": source, "dataset_id": ref.hub_id, "dataset_config": ref.config,
                  "dataset_split": ref.split, "dataset_revision": source, "data_path": str(path)}
    return read_records(path), provenance


class Record(dict):
    """One data record; reading a field it lacks names the file and the fields it has (a ConfigError, not a
    bare KeyError deep inside a task)."""

    origin: str = ""

    def __missing__(self, key):
        raise ConfigError(f"{self.origin} has no field '{key}'; its fields: {', '.join(sorted(self))}")


def read_records(path: Path) -> list[dict]:
    """jsonl (one object per line), json (a list of objects) or parquet; a file that cannot be parsed or
    holds no records is an error naming it."""
    try:
        if path.suffix == ".parquet":
            import pandas as pd

            rows = pd.read_parquet(path).to_dict(orient="records")
        elif path.suffix == ".json":
            rows = json.loads(path.read_text(encoding="utf-8"))
        else:
            rows = []
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    rows.append(_json_line(path, number, line))
    except ConfigError:
        raise
    except (OSError, ValueError) as err:  # JSON, UTF-8 and parquet errors are ValueErrors
        raise ConfigError(f"data file {path} cannot be read: {type(err).__name__}: {err}") from None
    if not rows:
        raise ConfigError(f"data file {path} holds no records")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"data file {path} must hold one JSON object per record")
    return [_record(row, f"data file {path} record {i}") for i, row in enumerate(rows)]


def _json_line(path: Path, number: int, line: str) -> dict:
    try:
        return json.loads(line)
    except ValueError as err:
        raise ConfigError(f"data file {path} line {number} is not JSON ({err})") from None


def _record(row: dict, origin: str) -> Record:
    record = Record(row)
    record.origin = origin
    return record


def _from_hub(ref: DataRef, revision: str | None) -> tuple[list[dict], dict]:
    local_hint = (f"download the files and set task.source=local task.data_dir=DIR (looked up there as "
                  f"{ref.files[0]}), or use task.source=sample")
    try:
        import datasets
    except ImportError as err:
        raise ConfigError(f"task.source=hub needs the 'datasets' package (pip install datasets); "
                          f"or {local_hint}") from err
    try:
        data = datasets.load_dataset(ref.hub_id, ref.config, split=ref.split, revision=revision)
    except Exception as err:  # noqa: BLE001 - offline, unknown config, script datasets on datasets>=4 ...
        reason = " ".join(str(err).split())[:160]
        raise ConfigError(f"could not load {ref.hub_id} '{ref.config}' ({ref.split}) from the HF hub "
                          f"({type(err).__name__}: {reason}); {local_hint}") from err
    provenance = {"data_source": "hub", "dataset_id": ref.hub_id, "dataset_config": ref.config,
                  "dataset_split": ref.split, "dataset_revision": _resolved_revision(ref.hub_id, revision),
                  "data_path": ""}
    return [_record(dict(row), f"{ref.hub_id} '{ref.config}' ({ref.split}) record {i}")
            for i, row in enumerate(data)], provenance


def _resolved_revision(hub_id: str, revision: str | None) -> str:
    """The commit sha the hub serves for ``revision`` (what was actually read), else the name asked for."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(hub_id, revision=revision).sha or (revision or "main")
    except Exception:  # noqa: BLE001 - provenance is best effort once the data itself has loaded
        return revision or "main"
