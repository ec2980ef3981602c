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
