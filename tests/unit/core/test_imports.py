"""The import rules as tests: the layers and the import-linter contracts of pyproject.toml hold, no two
modules import each other (directly or around a loop), and no interface (``base.py``) imports its siblings."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
from conftest import REPO

import echo2

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
    assert "echo2.flows" in named and CONFIG["root_packages"] == ["echo2"]


def _graph() -> grimp.ImportGraph:
    """Every import among echo2's modules (echo2/flows/ among them), lazy ones (inside functions) included: a
    loop closed at call time is still a loop to a reader. No cache: the test sees the tree as it is."""
    return grimp.build_graph(*CONFIG["root_packages"], cache_dir=None)


def test_no_two_modules_import_each_other():
    """No import loop among echo2's modules, direct (a ↔ b) or around a longer loop: every
    direct import a → b is checked for a way back from b to a, so every loop is found through one of
    its imports. A package's ``__init__`` counts as a module: an implementation that imports its
    interface from the package that builds it (``from echo2.x import Base``) closes a loop too."""
    graph = _graph()
    loops = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back:
                loops.setdefault(frozenset(back), " -> ".join((importer, *back)))
    assert not loops, "import loops (import the interface from base.py, pass a record, not the object):\n" + \
        "\n".join(sorted(loops.values()))


def test_no_base_module_imports_its_siblings():
    """An interface (``base.py``) never imports the implementations beside it (a sibling that imports the base,
    directly or through others), nor its own package (whose ``__init__`` builds them): the implementations import
    it, so that would be a loop. A sibling that is not an implementation (``fleet/prices/catalog.py``, the rows
    every source returns) may be imported. Every ``base.py`` in echo2 is checked, so a new package's interface is
    covered without naming it here."""
    graph = _graph()
    bases = sorted(".".join(p.relative_to(REPO).with_suffix("").parts) for p in (REPO / "echo2").rglob("base.py"))
    assert "echo2.tasks.base" in bases
    wrong = {}
    for base in bases:
        package = base.rpartition(".")[0]
        family = {package} | graph.find_descendants(package)
        siblings = sorted(m for m in (graph.find_modules_directly_imported_by(base) & family) - {base}
                          if m == package or graph.chain_exists(importer=m, imported=base))
        if siblings:
            wrong[base] = siblings
    assert not wrong, f"base.py imports its implementations or its own package: {wrong}"


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
