"""DESIGN.md's layer rules as a test: the import-linter contracts of pyproject.toml hold."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import echo2
from conftest import REPO

CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    assert lint.exists(), f"{lint} is missing: `make setup` installs the dev extra (import-linter)"
    proc = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = len(CONFIG["contracts"])
    assert f"Contracts: {n} kept, 0 broken." in proc.stdout, proc.stdout


def test_every_top_level_module_has_a_layer():
    """A new module of echo2 gets a place in the layers contract, not a free pass."""
    layers = next(c for c in CONFIG["contracts"] if c["type"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    modules = {f"echo2.{m.name}" for m in pkgutil.iter_modules(echo2.__path__)} - {"echo2.__main__"}
    assert modules - named == set(), "add these to [tool.importlinter]'s layers in pyproject.toml"
    assert "flows" in named and set(CONFIG["root_packages"]) == {"echo2", "flows"}


def _closure(requirements: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """Every distribution a set of requirements pulls in, transitively, as the installed metadata says."""
    from importlib.metadata import PackageNotFoundError, requires
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, active = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (active or ("",))):
            continue
        name = canonicalize_name(req.name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            todo += [(Requirement(r), tuple(req.extras)) for r in requires(req.name) or []]
        except PackageNotFoundError:  # optional and not installed here: it pulls nothing we can see
            continue
    return {k.split("[")[0] for k in seen}


def test_an_actor_only_install_pulls_no_prefect():
    """vLLM and Prefect pin incompatible fastapi versions: `pip install echo2` / `echo2[actor]` (what an
    actor's machine installs) must not bring Prefect, and neither must its own dependencies."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    actor = project["dependencies"] + project["optional-dependencies"]["actor"]
    pulled = _closure(actor)
    assert "torch" in pulled and "pyarrow" in pulled  # the walk follows the real metadata
    assert not {"prefect", "fastapi", "tensorboard", "matplotlib"} & pulled, sorted(pulled)
    learner = _closure(project["optional-dependencies"]["learner"])
    assert "prefect" in learner and "fastapi" in learner  # what the learner side does pull


def test_vllm_is_pinned_below_the_next_minor_version():
    """The vLLM engine reaches into vLLM internals (``echo2/rollout/vllm_engine.py``) that change between
    minor versions: the extra admits the versions it was run with (0.32, 0.33) and nothing newer."""
    from packaging.requirements import Requirement

    (spec,) = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    req = Requirement(spec)
    admitted = set(req.specifier.filter(["0.31.0", "0.32.0", "0.33.0", "0.33.2", "0.34.0", "0.35.1", "1.0.0"]))
    assert req.name == "vllm" and admitted == {"0.32.0", "0.33.0", "0.33.2"}, spec


def test_echo2_run_without_the_learner_extra_says_how_to_install_it():
    """An actor-only machine that runs `echo2 run`: one line naming the extra, exit 2."""
    code = ("import sys, importlib.util as u; real = u.find_spec\n"
            "u.find_spec = lambda n, *a: None if n.split('.')[0] == 'prefect' else real(n, *a)\n"
            "from echo2.cli import app; sys.argv = ['echo2', 'run', 'configs/quickstart.yaml']; app()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "pip install 'echo2[learner]'" in proc.stderr and "prefect" in proc.stderr
