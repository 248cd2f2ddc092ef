"""The ``kvbench`` command: ``kvbench status [ROOT]``, ``kvbench report …``, ``kvbench bench …``;
anything else is passed to the Hydra app (``kvbench method=h2o budget=0.2`` = ``python -m kvbench …``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def status(argv: list[str]) -> int:
    """Which runs under a results root are done, running, failed (with the error) or stale."""
    from kvbench import store

    root = Path(argv[0]) if argv else Path("results")
    if not root.exists():
        print(f"kvbench: error: results root '{root}' does not exist", file=sys.stderr)
        return 2
    states = store.run_states(root)
    table = Table(title=f"kvbench runs in {root}")
    for col in ("run_id", "state", "model", "method", "budget", "task", "host", "slurm job", "detail"):
        table.add_column(col)
    for rec in sorted(states, key=lambda r: (r["state"], r.get("model", ""), r.get("method", ""))):
        detail = rec.get("error", "") if rec["state"] == "failed" else ""
        if rec["state"] == "running":
            detail = f"for {time.time() - rec['time']:.0f} s"
        table.add_row(rec["run_id"], rec["state"], str(rec.get("model", "")), str(rec.get("method", "")),
                      str(rec.get("budget", "")), str(rec.get("task", "")), str(rec.get("host", rec.get("hostname", ""))),
                      str(rec.get("slurm_job_id") or ""), detail)
    Console(width=200).print(table)
    counts = {s: sum(r["state"] == s for r in states) for s in ("done", "running", "failed", "stale")}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0


def main() -> None:
    argv = sys.argv[1:]
    command = argv[0] if argv else ""
    if command == "status":
        sys.exit(status(argv[1:]))
    if command in ("report", "bench"):
        module = __import__(f"kvbench.{command}", fromlist=["main"])
        sys.argv = [f"kvbench {command}", *argv[1:]]
        sys.exit(module.main())
    from kvbench.__main__ import entry

    entry()
