"""scripts/gpu_wheels.py: one wheel per package, each installable on the GPU image; the on-machine check names
an unmet requirement."""

from __future__ import annotations

import pytest

from scripts.gpu_wheels import check, prune


def touch(folder, *names):
    for name in names:
        (folder / name).write_bytes(b"")


def test_prune_keeps_one_version_of_each_carried_package(tmp_path):
    wanted = ["bar-2.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "defused-0.7-py2.py3-none-any.whl",
              "foo-1.0-py3-none-any.whl"]
    touch(tmp_path, *wanted, "foo-0.9-py3-none-any.whl", "old_dep-3.0-py3-none-any.whl")
    kept = prune(tmp_path, {"foo": "1.0", "bar": "2.0", "defused": "0.7"})
    assert sorted(w.name for w in kept) == sorted(w.name for w in tmp_path.iterdir()) == wanted


def test_a_wheel_for_another_python_or_platform_is_refused(tmp_path):
    touch(tmp_path, "baz-1.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    with pytest.raises(SystemExit, match="baz-1.0-cp311.*does not install on cp312"):
        prune(tmp_path, {"baz": "1.0"})


def test_check_names_a_requirement_nothing_installed_meets(tmp_path):
    info = tmp_path / "carried-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: carried\nVersion: 1.0\n"
                                   "Requires-Dist: packaging>=1\nRequires-Dist: packaging<1\n"
                                   "Requires-Dist: kvbench-absent-package-xyz\n"
                                   "Requires-Dist: kvbench-other-absent; extra == \"docs\"\n")
    problems = check(tmp_path)
    assert len(problems) == 2
    assert problems[0].startswith("carried needs packaging<1: found ")
    assert problems[1] == "carried needs kvbench-absent-package-xyz: not installed"
