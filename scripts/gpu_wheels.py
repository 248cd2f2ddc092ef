"""Wheels of every kvbench dependency the GPU image lacks, downloaded here into .whl/ (git-ignored).

The GPU machine reaches no package index: what its image lacks travels in .whl/ with the working tree
(64 MiB in all) and ``scripts/gpu_session.sh setup`` installs it with ``pip install --no-index``. Here, a
Python 3.12 (the image's minor version) resolves, in a pip dry run (metadata only), kvbench's dependencies
(pyproject.toml: the project's and the dev extra's) that the image lacks, holding the image's packages
(scripts/gpu_image_packages.txt) at their known versions; every resolved package the image lacks is then
downloaded as a cp312 manylinux x86_64 wheel, or built here as a pure-Python wheel where the index has only
a source archive (jieba, antlr4-python3-runtime 4.9.3, ...). One version of each; older files are removed.

    python scripts/gpu_wheels.py                       # .whl/, without the dependencies in WITHOUT
    python scripts/gpu_wheels.py --without ''          # every dependency (56 MiB: over the limit)

Prints one line per wheel and the total, and exits 1 past ``--limit-mib``. On the GPU machine, after
``setup``, ``--check SITE`` checks every installed wheel's requirements against that environment (the image
plus SITE, no index needed) and imports every kvbench module; it prints each problem and exits 1 if any.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.metadata
import json
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
IMAGE_PACKAGES = Path(__file__).with_name("gpu_image_packages.txt")
# Too large to travel: wandb is 23 MiB with its own needs (the rest is 33 MiB, the working tree 5 MiB, the limit
# 64 MiB). kvbench imports it only for logger=wandb, which is refused with one line where it is missing.
WITHOUT = ("wandb",)
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
IMAGE_TAGS = {*cpython_tags((3, 12), platforms=PLATFORMS), *compatible_tags((3, 12), "cp312", PLATFORMS)}


def image_packages() -> dict[str, str | None]:
    """The image's packages: canonical name -> version where known."""
    packages = {}
    for line in IMAGE_PACKAGES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            packages[canonicalize_name(name)] = version or None
    return packages


def kvbench_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def python312(given: str | None) -> str:
    """A Python 3.12 interpreter that runs (a pyenv shim can be on PATH for a version it does not select)."""
    candidates = [given] if given else [shutil.which("python3.12"), *sorted(glob.glob(
        str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12")))]
    for candidate in filter(None, candidates):
        run = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True)
        if run.returncode == 0 and run.stdout.strip() == "(3, 12)":
            return candidate
    sys.exit(f"gpu_wheels: no working Python 3.12 among {[c for c in candidates if c]}; pass --python PATH")


def resolve(python: str, wanted: list[str], pinned: list[str]) -> list[dict]:
    """pip's dry-run report (``install`` entries) for ``wanted`` under the constraints ``pinned``."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints, report = Path(tmp, "image.txt"), Path(tmp, "report.json")
        constraints.write_text("\n".join(pinned) + "\n")
        subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "-c", str(constraints), *wanted], check=True)
        return json.loads(report.read_text())["install"]


def fetch(python: str, packages: list[tuple[str, str, bool]], out: Path) -> None:
    """Wheels of (name, version, has_wheel) into ``out``: binary ones for the image's platform, the others built
    here (they must come out pure Python)."""
    binary = [f"{name}=={version}" for name, version, has_wheel in packages if has_wheel]
    if binary:
        platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
        subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(out), *binary],
                       check=True)
    for name, version, has_wheel in packages:
        if not has_wheel:
            subprocess.run([python, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out),
                            f"{name}=={version}"], check=True)


def prune(out: Path, keep: dict[str, str]) -> list[Path]:
    """Remove wheels of other packages or versions (two versions of one stop the install); the kept wheels."""
    kept = []
    for wheel in sorted(out.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        if name not in keep or Version(keep[name]) != version:
            wheel.unlink()
            continue
        if not tags & IMAGE_TAGS:
            sys.exit(f"gpu_wheels: {wheel.name} does not install on cp312 manylinux x86_64")
        kept.append(wheel)
    return kept


def check(site: Path) -> list[str]:
    """What is wrong with this environment for kvbench: a requirement of a wheel installed under ``site`` that
    no installed version meets, or a kvbench module that does not import."""
    problems = []
    for dist in importlib.metadata.distributions(path=[str(site)]):
        for requirement in map(Requirement, dist.requires or []):
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                found = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {requirement}: not installed")
                continue
            if not requirement.specifier.contains(found, prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {requirement}: found {found}")
    sys.path.insert(0, str(REPO))
    import kvbench

    modules = [m.name for m in pkgutil.walk_packages(kvbench.__path__, "kvbench.")
               if not m.name.endswith("__main__")]  # a __main__ module runs its command when imported
    modules.append("hydra_plugins.kvbench_launchers")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - every failure is a finding, reported by name
            problems.append(f"import {module}: {error!r}")
    print(f"gpu_wheels --check: {len(modules)} kvbench modules, the wheels under {site}: "
          f"{len(problems)} problems", *problems, sep="\n")
    return problems


def build(out: Path, without: set[str], python: str, limit_mib: float) -> int:
    """Resolve, download and prune ``out``; print the wheels and their total; 1 past ``limit_mib``."""
    image = image_packages()
    marker_env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    wanted = [str(r) for r in kvbench_requirements() if canonicalize_name(r.name) not in set(image) | without
              and (r.marker is None or r.marker.evaluate(marker_env))]
    pinned = [f"{name}=={version}" for name, version in image.items() if version]
    print(f"gpu_wheels: resolving {', '.join(wanted)} with {python}; image pins: {', '.join(pinned)}")
    carried = {}  # name -> (version, whether the index has a wheel of it)
    for item in resolve(python, wanted, pinned):
        name = canonicalize_name(item["metadata"]["name"])
        if name not in image:
            carried[name] = (item["metadata"]["version"], item["download_info"]["url"].endswith(".whl"))
    out.mkdir(exist_ok=True)
    have = {parse_wheel_filename(w.name)[:2] for w in out.glob("*.whl")}
    fetch(python, [(name, version, has_wheel) for name, (version, has_wheel) in carried.items()
                   if (name, Version(version)) not in have], out)
    wheels = prune(out, {name: version for name, (version, _) in carried.items()})
    total = sum(wheel.stat().st_size for wheel in wheels)
    for wheel in sorted(wheels, key=lambda w: -w.stat().st_size):
        print(f"{wheel.stat().st_size / 2**20:8.2f} MiB  {wheel.name}")
    print(f"gpu_wheels: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {out} (limit {limit_mib:g} MiB); "
          f"not carried: {', '.join(sorted(without)) or 'none'}")
    return 0 if total <= limit_mib * 2**20 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / ".whl")
    parser.add_argument("--without", default=",".join(WITHOUT),
                        help="kvbench dependencies not carried, comma-separated (default: %(default)s)")
    parser.add_argument("--python", help="a Python 3.12 to resolve with (default: found on PATH or in pyenv)")
    parser.add_argument("--limit-mib", type=float, default=45.0)
    parser.add_argument("--check", type=Path, metavar="SITE",
                        help="on the GPU machine: check the wheels installed under SITE (see above)")
    args = parser.parse_args(argv)
    if args.check:
        return 1 if check(args.check) else 0
    without = {canonicalize_name(name) for name in args.without.split(",") if name}
    return build(args.out, without, python312(args.python), args.limit_mib)


if __name__ == "__main__":
    sys.exit(main())
