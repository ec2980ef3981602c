"""``fleet.extra_packages``: what actors need beside echo2 (a plugin task's package, a reward function's).

Each entry is a local path (a project folder, a ``.whl`` / ``.tar.gz``) or a pip requirement
(``echo2.config.fleet.is_local_package`` tells them apart). Two ways to get them onto actors:

- Local actors run the learner's interpreter (or ``fleet.actor_python``): echo2 installs nothing into it. Before
  the run starts, ``check_local_actors`` checks there that every requirement is installed at a version it admits,
  every local project is installed (by the name its ``pyproject.toml`` gives), and every module the task names
  imports; what is missing is one line saying what to install where.
- SkyPilot actors install them in their setup: ``stage_extra_packages`` copies each local path into the actor's
  staged workdir (``extra-packages/``, beside echo2's own source, ``skypilot_trust.stage_actor_source``) and writes
  ``extra-requirements.txt`` (those folders and the requirements), which the task file's setup installs after
  echo2. A folder travels without its caches and VCS data, symlinks are left behind (they could point anywhere),
  and a file that looks like a credential (``.env``, ``*.pem``, ``id_rsa``, ``.aws/``, ``~/.config/echo2/keys``
  ...) stops the launch in one line instead of reaching a machine we do not own.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from echo2.config.fleet import is_local_package
from echo2.errors import Echo2InputError

STAGED_FOLDER = "extra-packages"
"""Where a workdir holds the local packages (``extra-packages/<n>-<name>``)."""
REQUIREMENTS_FILE = "extra-requirements.txt"
"""What the actor's setup installs with ``pip install -r`` after echo2 (``infra/skypilot/actor.yaml``)."""
MAX_STAGED_BYTES = 64 * 2**20
"""Most a local package may add to every actor's upload: data sets travel through the store or a bucket."""

SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", ".venv", "venv", ".tox", ".nox", ".mypy_cache",
                          ".pytest_cache", ".ruff_cache", "node_modules", "build", "dist", ".eggs"})
"""Folders of a project that never travel: caches, VCS data, virtual environments, build outputs."""
CREDENTIAL_DIRS = frozenset({".aws", ".ssh", ".gnupg", ".azure", ".kube", ".docker", "gcloud", ".sky", "keys",
                             ".config"})
"""Folders that hold credentials where they usually live (``~/.aws``, ``~/.config/gcloud``, echo2's run keys)."""
CREDENTIAL_NAMES = frozenset({".env", ".netrc", ".pypirc", ".git-credentials", "credentials", "credentials.json",
                              "id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", ".npmrc", "service-account.json"})
CREDENTIAL_SUFFIXES = (".pem", ".key", ".p12", ".pfx", ".jks", ".keystore", ".ppk", ".kdbx", ".gpg", ".asc")


class ExtraPackageError(Echo2InputError):
    """A ``fleet.extra_packages`` entry that cannot be staged or is not installed where local actors run."""


# -- SkyPilot: staged beside echo2's source ---------------------------------------------------------------
def looks_like_credential(relative: Path) -> bool:
    """Whether a file, by its path inside a package, looks like a secret that must not leave this machine."""
    name = relative.name.lower()
    if name in CREDENTIAL_NAMES or name.startswith(".env.") or name.endswith(CREDENTIAL_SUFFIXES):
        return True
    return any(part.lower() in CREDENTIAL_DIRS for part in relative.parts[:-1])


def _secrets_folder() -> Path:
    """Where echo2 keeps run keys (``echo2/data/run_key.py``): no package may contain it or sit in it."""
    return Path(os.environ.get("ECHO2_SECRETS", Path.home() / ".config" / "echo2" / "keys")).expanduser().resolve()


def _project_files(root: Path) -> list[Path]:
    """The files of a project folder that travel, relative to it; refuses the folder on a credential."""
    keys = _secrets_folder()
    if root == Path.home().resolve() or keys == root or root in keys.parents or keys in root.parents:
        raise ExtraPackageError(f"fleet.extra_packages {root}: a home folder or echo2's key folder never travels "
                                f"to an actor; name the package's own project folder")
    found, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        for filename in sorted(filenames):
            path = Path(dirpath) / filename
            relative = path.relative_to(root)
            if path.is_symlink():
                continue  # only the package's own files travel
            if looks_like_credential(relative):
                raise ExtraPackageError(f"fleet.extra_packages {root}: {relative} looks like a credential and would "
                                        f"be copied to every actor VM: move it out of the package")
            total += path.stat().st_size
            if total > MAX_STAGED_BYTES:
                raise ExtraPackageError(f"fleet.extra_packages {root}: more than {MAX_STAGED_BYTES // 2**20} MiB "
                                        f"would travel to every actor: keep data out of the package (the store, a "
                                        f"bucket)")
            found.append(relative)
    return found


def stage_extra_packages(packages: list[str], workdir: Path) -> list[str]:
    """Copy the local ``packages`` into ``workdir/extra-packages/`` and write ``workdir/extra-requirements.txt``
    (nothing where ``packages`` is empty); the requirements file's lines, in order."""
    if not packages:
        return []
    lines = []
    for number, item in enumerate(packages):
        if not is_local_package(item):
            lines.append(item.strip())
            continue
        source = Path(item).expanduser().resolve()
        if source.is_dir():
            if not ((source / "pyproject.toml").is_file() or (source / "setup.py").is_file()):
                raise ExtraPackageError(f"fleet.extra_packages {item}: no pyproject.toml or setup.py in {source}: "
                                        f"pip could not install it")
            dest = workdir / STAGED_FOLDER / f"{number}-{source.name}"
            for relative in _project_files(source):
                (dest / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source / relative, dest / relative)
        elif source.is_file():
            if source.stat().st_size > MAX_STAGED_BYTES:
                raise ExtraPackageError(f"fleet.extra_packages {item}: over {MAX_STAGED_BYTES // 2**20} MiB")
            dest = workdir / STAGED_FOLDER / f"{number}-{source.stem.split('.')[0]}" / source.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)  # keeps its name: pip reads the version from a wheel's file name
        else:
            raise ExtraPackageError(f"fleet.extra_packages {item}: {source} does not exist")
        lines.append("./" + dest.relative_to(workdir).as_posix())
    (workdir / REQUIREMENTS_FILE).write_text("".join(f"{line}\n" for line in lines))
    return lines


# -- local actors: the interpreter they run must have them already ---------------------------------------
def installed(names: list[str], modules: list[str]) -> dict:
    """The installed version of each distribution of ``names`` (None: not installed) and whether each module of
    ``modules`` is found, in the interpreter that runs this. Self-contained: another interpreter runs its source."""
    import importlib.util
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    def importable(module):
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    return {"versions": {n: version(n) for n in names}, "modules": {m: importable(m) for m in modules}}


def project_name(item: str) -> str | None:
    """The distribution name of a local package: its ``pyproject.toml``'s ``[project] name``, or a wheel's or
    archive's file name; None where neither says (a ``setup.py``-only project)."""
    source = Path(item).expanduser()
    if source.is_file():
        return source.name.split("-", 1)[0] if "-" in source.name else None
    try:
        return tomllib.loads((source / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None


def _probe(python: str | None, names: list[str], modules: list[str]) -> dict:
    """``installed`` in ``python`` (None: this interpreter)."""
    if python is None:
        return installed(names, modules)
    code = (f"import json, sys\n{inspect.getsource(installed)}\n"
            f"print(json.dumps(installed(json.loads(sys.argv[1]), json.loads(sys.argv[2]))))")
    try:
        proc = subprocess.run([python, "-c", code, json.dumps(names), json.dumps(modules)], capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ExtraPackageError(f"fleet.actor_python {python}: cannot run it: {exc}") from None
    if proc.returncode != 0:
        raise ExtraPackageError(f"fleet.actor_python {python}: exited {proc.returncode}: "
                                f"{(proc.stderr.strip().splitlines() or [''])[-1][:200]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_local_actors(packages: list[str], modules: list[str], actor_python: str | None = None) -> None:
    """Local actors run ``actor_python`` (None: this, the learner's, interpreter), which echo2 installs nothing
    into: every ``packages`` entry must be installed there and every module of ``modules`` import there. One line
    (``ExtraPackageError``) naming what is missing and how to install it."""
    from packaging.requirements import Requirement

    python = None if actor_python is None or Path(actor_python).resolve() == Path(sys.executable).resolve() \
        else actor_python
    where = f"fleet.actor_python {actor_python}" if python else f"the learner's interpreter {sys.executable}"
    wanted: list[tuple[str, str, Requirement | None]] = []  # (entry, distribution, requirement)
    for item in packages:
        if is_local_package(item):
            name = project_name(item)
            if name is None:
                if not Path(item).expanduser().exists():
                    raise ExtraPackageError(f"fleet.extra_packages {item}: no such file or folder")
                continue  # nothing names its distribution: the module check below still applies
            wanted.append((item, name, None))
        else:
            requirement = Requirement(item)
            wanted.append((item, requirement.name, requirement))
    found = _probe(python, [name for _, name, _ in wanted], modules)
    for item, name, requirement in wanted:
        version = found["versions"].get(name)
        install = f"pip install {item!r}" if python is None else f"{actor_python} -m pip install {item!r}"
        if version is None:
            raise ExtraPackageError(f"fleet.extra_packages {item}: {name} is not installed in {where}, which local "
                                    f"actors run (echo2 installs packages on SkyPilot actors only): {install}")
        if requirement is not None and not requirement.specifier.contains(version, prereleases=True):
            raise ExtraPackageError(f"fleet.extra_packages {item}: {where} has {name} {version}: {install}")
    missing = [m for m in modules if not found["modules"].get(m)]
    if missing:
        raise ExtraPackageError(f"the task's module {missing[0]} does not import in {where}, which local actors "
                                f"run: install its package there (and list it in fleet.extra_packages)")
