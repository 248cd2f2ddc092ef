"""``git_commit`` in result rows is kvbench's own repository's commit, or None: never that of another
repository that happens to hold a copy of the code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvbench
from tests.conftest import REPO

GIT = ["git", "-c", "user.name=kvbench-test", "-c", "user.email=test@kvbench.invalid", "-c", "init.defaultBranch=main"]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def other_repository(path: Path) -> Path:
    """A git repository with one commit of its own."""
    path.mkdir()
    git(path, "init", "-q")
    (path / "README").write_text("another project\n")
    git(path, "add", "README")
    git(path, "commit", "-qm", "another project")
    return path


def copy_package(into: Path) -> None:
    shutil.copytree(REPO / "kvbench", into / "kvbench", ignore=shutil.ignore_patterns("__pycache__"))


def recorded_version(import_root: Path) -> dict:
    """``kvbench.code_version()`` of the copy under ``import_root``, in a fresh interpreter run from elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["PYTHONPATH"] = str(import_root)
    code = "import json, kvbench; assert kvbench.__file__.startswith(%r); print(json.dumps(kvbench.code_version()))"
    out = subprocess.run([sys.executable, "-c", code % str(import_root)], cwd=import_root.parent, env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


@pytest.fixture
def has_git():
    if shutil.which("git") is None:
        pytest.skip("needs git")


def test_this_checkout_records_its_own_head(has_git):
    if not (REPO / ".git").exists():
        pytest.skip("not run from a git checkout")
    assert kvbench.code_version()["git_commit"] == git(REPO, "rev-parse", "HEAD")


def test_a_copy_vendored_inside_another_repository_records_no_commit(tmp_path, has_git):
    other = other_repository(tmp_path / "other")
    copy_package(other / "vendor")
    git(other, "add", "vendor")
    git(other, "commit", "-qm", "vendor kvbench")
    assert recorded_version(other / "vendor") == {"kvbench_version": kvbench.__version__, "git_commit": None}


def test_a_bare_package_at_another_repositorys_top_level_records_no_commit(tmp_path, has_git):
    """The package alone (as pip leaves it, without kvbench's pyproject.toml) at another repository's root."""
    other = other_repository(tmp_path / "other")
    copy_package(other)
    assert recorded_version(other)["git_commit"] is None


def test_a_clone_of_kvbench_records_its_head(tmp_path, has_git):
    """The check does not reject kvbench's own repository when it lives somewhere else."""
    clone = tmp_path / "kvbench"
    clone.mkdir()
    git(clone, "init", "-q")
    copy_package(clone)
    shutil.copy(REPO / "pyproject.toml", clone)
    git(clone, "add", ".")
    git(clone, "commit", "-qm", "kvbench")
    assert recorded_version(clone)["git_commit"] == git(clone, "rev-parse", "HEAD")
