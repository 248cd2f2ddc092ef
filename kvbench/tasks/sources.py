"""Where benchmark records come from: ``task.source=hub|local|sample``.

* ``hub``: the benchmark's own data files, fetched from the HF hub with ``huggingface_hub`` into its cache
  (``HF_HOME``; ``HF_ENDPOINT`` picks the server) and read by the same readers as local files. No
  ``datasets`` loading scripts are run (``datasets>=4`` refuses them): LongBench's ``data.zip``,
  ZeroSCROLLS' ``<task>.zip``, the parquet files of PG19 and GSM8K. The commit sha the hub served is
  recorded as the revision;
* ``local``: the same records as files under ``task.data_dir`` (jsonl, json or parquet; see each task for
  the file names it looks for), for machines without the hub;
* ``sample``: the small fixtures shipped in ``kvbench/data/<benchmark>/sample`` (real field layout,
  synthetic short texts; scores on them mean nothing).

Every record set comes with its provenance (source, dataset id, config, revision or file), which tasks copy
into ``Sample.meta`` so it lands in every result row.
"""

from __future__ import annotations

import fnmatch
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvbench.errors import ConfigError, unknown_name

SOURCES = ("hub", "local", "sample")
PACKAGE_DATA = Path(__file__).resolve().parent.parent / "data"


@dataclass(frozen=True)
class DataRef:
    """One record set: where it is in the hub repository, and the file names it has in a local/sample folder."""

    hub_id: str
    config: str
    split: str
    files: tuple[str, ...]  # relative paths tried in order under data_dir / the sample directory
    hub_file: str  # path in the hub repository: a records file, a zip archive (see member) or a glob of shards
    member: str | None = None  # the records file inside the zip archive ``hub_file``


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
        paths, sha = hub_files(ref.hub_id, ref.hub_file, revision)
        records = [r for path in paths for r in read_records(path, ref.member)]
        where = ref.hub_file + (f"::{ref.member}" if ref.member else "")
        return records, {"data_source": "hub", "dataset_id": ref.hub_id, "dataset_config": ref.config,
                         "dataset_split": ref.split, "dataset_revision": sha, "data_path": where}
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


def read_records(path: Path, member: str | None = None) -> list[dict]:
    """jsonl (one object per line), json (a list of objects) or parquet; ``member``: that file inside the
    zip archive ``path`` (read in place, not extracted). A file that cannot be parsed or holds no records is
    an error naming it."""
    where = f"{path}::{member}" if member is not None else str(path)
    try:
        if member is not None:
            with zipfile.ZipFile(path) as archive:
                data, suffix = archive.read(member), Path(member).suffix
        else:
            data, suffix = Path(path).read_bytes(), Path(path).suffix
        rows = _parse(data, suffix, where)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:  # JSON/UTF-8/parquet errors: ValueError
        raise ConfigError(f"data file {where} cannot be read: {type(err).__name__}: {err}") from None
    if not rows:
        raise ConfigError(f"data file {where} holds no records")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"data file {where} must hold one JSON object per record")
    return [_record(row, f"data file {where} record {i}") for i, row in enumerate(rows)]


def _parse(data: bytes, suffix: str, where: str) -> list:
    if suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(io.BytesIO(data)).to_dict(orient="records")
    text = data.decode("utf-8")
    if suffix == ".json":
        return json.loads(text)
    return [_json_line(where, number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _json_line(where: str, number: int, line: str) -> dict:
    try:
        return json.loads(line)
    except ValueError as err:
        raise ConfigError(f"data file {where} line {number} is not JSON ({err})") from None


def _record(row: dict, origin: str) -> Record:
    record = Record(row)
    record.origin = origin
    return record


def hub_files(hub_id: str, pattern: str, revision: str | None) -> tuple[list[Path], str]:
    """Local paths of the dataset repository's file ``pattern`` (or of every file matching it, if it is a
    glob) at ``revision`` (default: main), downloaded once into the huggingface_hub cache, and the commit sha
    they come from. One request (the repository's file list) tells whether the hub answers; when it does
    not (no connection, HF_HUB_OFFLINE), the cached files of that revision are used without another request
    (huggingface_hub would retry each file for about 25 s first)."""
    from huggingface_hub import hf_hub_download

    listing, unreachable = _hub_listing(hub_id, revision)
    try:
        names = _matching(hub_id, pattern, revision, listing) if _is_glob(pattern) else [pattern]
        paths = [Path(hf_hub_download(hub_id, name, repo_type="dataset", revision=revision,
                                      local_files_only=listing is None)) for name in names]
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - not cached, unknown file, HTTP errors ...
        why = f"the hub cannot be reached ({unreachable}) and the file is not in the cache" if listing is None \
            else f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
        raise ConfigError(f"could not fetch '{pattern}' of {hub_id} (revision {revision or 'main'}) from the HF "
                          f"hub ({why}); download it and set task.source=local task.data_dir=DIR, or use "
                          "task.source=sample") from err
    commits = {snapshot_commit(path, name) for path, name in zip(paths, names)}
    if len(commits) > 1:  # the branch moved between two downloads
        raise ConfigError(f"{hub_id} files '{pattern}' came from several commits {sorted(commits)}; run again "
                          "or pin task.revision to one commit")
    return paths, commits.pop()


def _hub_listing(hub_id: str, revision: str | None) -> tuple[list[str] | None, str]:
    """The repository's file names at ``revision``, or (None, why) when the hub cannot be reached (no
    connection, HF_HUB_OFFLINE, a server error). A hub that answers no (unknown repository or revision, no
    access) is a ConfigError."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi().dataset_info(hub_id, revision=revision)
    except HfHubHTTPError as err:
        code = getattr(err.response, "status_code", None)
        if code is None or code >= 500 or code == 429:
            return None, f"HTTP {code}"
        raise ConfigError(f"the HF hub answers {code} for dataset {hub_id} at revision {revision or 'main'} "
                          f"({str(err).splitlines()[0][:200]}); check the name and revision, or use "
                          "task.source=local task.data_dir=DIR") from None
    except Exception as err:  # noqa: BLE001 - connection errors of every HTTP backend, offline mode
        if type(err).__name__ == "OfflineModeIsEnabled":
            return None, "HF_HUB_OFFLINE is set"
        return None, f"{type(err).__name__}: {' '.join(str(err).split())[:120]}"
    return [s.rfilename for s in info.siblings or []], ""


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _matching(hub_id: str, pattern: str, revision: str | None, listing: list[str] | None) -> list[str]:
    """Files of the revision that match the glob: from the hub's file list, or from the cached snapshot when
    the hub cannot be reached (``listing`` None; raises if nothing is cached)."""
    from huggingface_hub import snapshot_download

    names = listing
    if names is None:
        folder = Path(snapshot_download(hub_id, repo_type="dataset", revision=revision, allow_patterns=[pattern],
                                        local_files_only=True))
        names = [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]
    names = sorted(n for n in names if fnmatch.fnmatch(n, pattern))
    if not names:
        raise ConfigError(f"{hub_id} at revision {revision or 'main'} has no file matching '{pattern}'")
    return names


def snapshot_commit(path: Path, name: str) -> str:
    """The commit sha of a file returned by ``hf_hub_download``: its cache path is
    ``<repo folder>/snapshots/<commit sha>/<name>``."""
    return path.parents[len(Path(name).parts) - 1].name
