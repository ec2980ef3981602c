"""echo2 installed from its wheel, with no checkout in sight: the wheel is built from this working tree,
installed into a fresh venv, and ``echo2 plan`` and ``echo2 prices`` run there from a folder outside the
repository. The files they read (the price catalog, the worker profiles) must travel inside the wheel
(``infra/`` as ``echo2._infra``, found by ``echo2.shipped``), not be found beside the checkout.

Nothing is downloaded: the wheel is built without build isolation (setuptools from this environment) and
installed without dependencies; the fresh venv sees this environment's site-packages for those through a
``.pth`` line, which adds the folder but runs none of its ``.pth`` files (so not the editable install's
finder, which would map ``echo2`` back onto the checkout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e

SOURCE = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "echo2", "infra")
"""What the build reads: the project files and the package folders (setup.py's package list)."""


def _run(*args, ok=(0,), **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, **kw)
    assert proc.returncode in ok, f"{args}: {proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding echo2 from its wheel; returns the venv's folder."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    for name in SOURCE:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "-w", root / "dist", src)
    (wheel,) = (root / "dist").glob("echo2-*.whl")
    venv = root / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet", wheel)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "echo2-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def test_the_installed_package_and_its_shipped_files_come_from_the_venv(installed, tmp_path):
    code = ("import json, sys, echo2, echo2.fleet.prices.catalog as p, echo2.fleet.backends.skypilot_task as s\n"
            "print(json.dumps({'package': echo2.__file__, 'files': [str(p.DEFAULT_CATALOG), str(p.DEFAULT_PROFILES),"
            " str(s.DEFAULT_TASK_FILE)], 'editable': [m for m in sys.modules if m.startswith('__editable__')]}))")
    out = json.loads(_run(installed / "bin" / "python", "-c", code, cwd=tmp_path, env=_env()).stdout)
    assert not out["editable"], out
    for path in (out["package"], *out["files"]):
        assert Path(path).is_relative_to(installed) and not Path(path).is_relative_to(REPO), path
        assert Path(path).is_file(), path
    files = _run(sys.executable, "-m", "zipfile", "-l", next((installed.parent / "dist").glob("*.whl"))).stdout
    for name in ("echo2/py.typed", "echo2/_infra/prices/README.md", "echo2/_infra/iam/actor-policy.json",
                 "echo2/bench/learner_configs/qwen3-8b.json", "echo2/flows/train.py", "licenses/LICENSE"):
        assert name in files, name
    assert not [line for line in files.splitlines() if line.startswith("flows/")], "the flows ship inside echo2"


def test_plan_and_prices_run_from_the_wheel(installed, tmp_path):
    echo2 = installed / "bin" / "echo2"
    # exit 1 with the JSON on stdout when the asked S has no plan (the defaults' S=2 has none in this catalog)
    proc = _run(echo2, "plan", "--model-params", "7", "--json", ok=(0, 1), cwd=tmp_path, env=_env())
    plan = json.loads(proc.stdout)
    assert proc.returncode == 0 or proc.stderr.startswith("no plan:"), proc.stderr
    assert plan["required_throughput"] > 0 and plan["neighbours"], plan
    fleets = [row for p in (plan, *plan["neighbours"]) for row in p["fleet"]]
    assert fleets and all(row["offer"]["name"] for row in fleets), plan  # some S is met by catalog offers
    offers = json.loads(_run(echo2, "prices", "--json", cwd=tmp_path, env=_env()).stdout)
    assert len(offers) > 100 and {"name", "gpu", "spot_usd_per_hour"} <= set(offers[0]), offers[:1]
