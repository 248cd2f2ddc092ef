"""The ``kvbench`` command: ``kvbench run|status|collect|report|bench …``; ``kvbench run ARGS`` and a bare
``kvbench ARGS`` are the Hydra app (``kvbench method=h2o budget=0.2`` = ``python -m kvbench …``).
``kvbench --help`` lists the subcommands and the config groups with their choices."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

CONF = Path(__file__).resolve().parent.parent / "conf"
STATES = ("done", "running", "failed", "stale", "interrupted", "corrupt")  # the first four always counted
HELP_GROUPS = ("model", "method", "budget", "task", "logger", "kernels", "hydra/launcher", "experiment")


def default_root() -> Path:
    return Path(os.environ.get("KVBENCH_RESULTS") or "results")


def usage() -> str:
    """Subcommands, config groups with their choices (default marked *) and the top-level keys."""
    config = yaml.safe_load((CONF / "config.yaml").read_text())
    defaults = {}
    for entry in config["defaults"]:
        if isinstance(entry, dict):
            for key, value in entry.items():
                defaults[key.removeprefix("override ").removeprefix("/")] = str(value)
    lines = [
        "usage: kvbench [run] [key=value ...]      one run (python -m kvbench ... is the same)",
        "       kvbench [run] -m key=a,b ...       a sweep; -m must come first",
        "       kvbench status [ROOT] [--stale-code]  done / running / failed / stale / interrupted / corrupt runs (ROOT: $KVBENCH_RESULTS or results)",
        "       kvbench collect [ROOT]             rebuild ROOT/metrics.parquet and predictions.parquet from ROOT/runs",
        "       kvbench report [--root ROOT] ...   tables and plots (kvbench report --help)",
        "       kvbench bench kernels ...          kernel timings (kvbench bench kernels --help)",
        "",
        "config groups (group=choice; * = default):",
    ]
    for group in HELP_GROUPS:
        choices = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        marked = [f"{c}*" if defaults.get(group) == c else c for c in choices]
        name = f"+{group}" if group == "experiment" else group
        lines.append(f"  {name:<16} {', '.join(marked)}")
    top = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in config.items()
           if k not in ("defaults", "hydra")]
    lines += ["", "top-level keys (defaults): " + " ".join(top),
              "budget is the kept fraction of the prompt (0.2 keeps 20 %), the inverse of a compression ratio;",
              "tokensN keeps N slots per key/value head. Hydra's own options: kvbench --hydra-help"]
    return "\n".join(lines)


def status(argv: list[str]) -> int:
    """Which runs under a results root are done, running, failed (with the error), stale, interrupted or
    corrupt (published, but not readable), with the command that runs each unfinished one again and whether
    the collected tables hold exactly the done runs; ``--stale-code``: only the finished runs made by
    another kvbench version or git commit."""
    from kvbench import code_version, status as run_status, store

    stale_code = "--stale-code" in argv
    paths = [a for a in argv if not a.startswith("-")]
    root = Path(paths[0]) if paths else default_root()
    if not root.exists():
        print(f"kvbench: error: results root '{root}' does not exist (set KVBENCH_RESULTS or pass ROOT)",
              file=sys.stderr)
        return 2
    states = run_status.run_states(root)
    if stale_code:
        current = code_version()
        states = [r for r in states if r["state"] == "done" and _other_code(r, current)]
    table = Table(title=f"kvbench runs in {root}" + (" made by other code" if stale_code else ""))
    columns = ["run_id", "state", "run", "host", "slurm job", "detail"] + (["version", "commit"] if stale_code else [])
    for col in columns:
        table.add_column(col)
    for rec in sorted(states, key=lambda r: (r["state"], store.run_label(r))):
        detail = {"done": "", "running": f"for {time.time() - rec.get('time', time.time()):.0f} s",
                  "stale": "its process is gone (crashed, killed or cancelled)"}.get(rec["state"], rec.get("error", ""))
        cells = [rec["run_id"], rec["state"], store.run_label(rec), str(rec.get("host", rec.get("hostname", ""))),
                 str(rec.get("slurm_job") or rec.get("slurm_job_id") or ""), detail]
        if stale_code:
            cells += [str(rec.get("kvbench_version")), str(rec.get("git_commit") or "")[:12]]
        table.add_row(*cells)
    Console(width=200).print(table)
    counts = {s: sum(r["state"] == s for r in states) for s in STATES}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n or s in STATES[:4]))
    todo = [r for r in states if r["state"] not in ("done", "running")]
    if todo:
        print("not finished (a re-run of their sweep runs them again):")
    for rec in sorted(todo, key=lambda r: r["run_id"]):
        print(f"  {rec['run_id']} {rec['state']}: {run_status.what_to_do(root, rec)}")
    stale = store.stale_tables(root, [r["run_id"] for r in states if r["state"] == "corrupt"])
    if stale:
        print(f"the collected tables in {root} are stale ({stale}): run `kvbench collect {root}`")
    return 0


def _other_code(record: dict, current: dict) -> bool:
    if record.get("kvbench_version") != current["kvbench_version"]:
        return True
    return bool(current["git_commit"]) and record.get("git_commit") != current["git_commit"]


def collect(argv: list[str]) -> int:
    """Rebuild the collected tables from ``runs/``; name the runs left out because they do not read back,
    each with the command that runs it again."""
    from kvbench import status as run_status, store
    from kvbench.errors import disk_full, disk_full_line

    root = Path(argv[0]) if argv else default_root()
    if not (root / store.RUNS).is_dir():
        print(f"kvbench: error: '{root}' has no {store.RUNS}/ folder: not a results root", file=sys.stderr)
        return 2
    try:
        skipped = store.collect(root)
    except OSError as err:
        full = disk_full(err)
        reason = disk_full_line(full, root) if full else f"{err.strerror or err} ({err.filename or root})"
        print(f"kvbench: error: the collected tables in {root} cannot be written: {reason}", file=sys.stderr)
        return 2
    runs = len(store.published_runs(root)) - len(skipped)
    print(f"kvbench collect: {runs} runs in {root / 'metrics.parquet'} and {root / 'predictions.parquet'}")
    for rid, reason in skipped:
        record = run_status.published_record(store.run_dir(root, rid))
        print(f"  skipped {store.run_dir(root, rid)}: {reason}; {run_status.what_to_do(root, record)}")
    return 0


def main() -> None:
    argv = sys.argv[1:]
    command = argv[0] if argv else ""
    if command == "status":
        sys.exit(status(argv[1:]))
    if command == "collect":
        sys.exit(collect(argv[1:]))
    if command in ("report", "bench"):
        module = __import__(f"kvbench.{command}", fromlist=["main"])
        sys.argv = [f"kvbench {command}", *argv[1:]]
        sys.exit(module.main())
    from kvbench.__main__ import entry

    if command == "run":
        sys.argv = [sys.argv[0], *argv[1:]]
    entry()
