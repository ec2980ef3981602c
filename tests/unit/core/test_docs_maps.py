"""The maps stay true: links and anchors in the docs resolve, docs and docstrings name only paths that exist, and
the README's command list and the Makefile's BENCHMARKS match the CLI they describe."""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TOP_DIRS = ("echo2", "docs", "configs", "infra", "tests")
SKIP_DIRS = {".git", ".venv", ".venv-vllm", "node_modules", "__pycache__", "echo2.egg-info", "echo2-logs", "build",
             "dist", "runs"}


def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _sources() -> list[Path]:
    return sorted(p for p in (REPO / "echo2").rglob("*.py") if "__pycache__" not in p.parts)


@lru_cache(maxsize=None)
def _repo_files() -> tuple[frozenset[str], frozenset[str]]:
    """Every file and every folder of the checkout (relative, '/'-separated), build and run outputs left out."""
    files, dirs = set(), set()
    stack = [REPO]
    while stack:
        here = stack.pop()
        for entry in here.iterdir():
            if entry.name in SKIP_DIRS and here == REPO or entry.name in {".git", "__pycache__"}:
                continue
            rel = entry.relative_to(REPO).as_posix()
            if entry.is_dir():
                dirs.add(rel)
                stack.append(entry)
            else:
                files.add(rel)
    return frozenset(files), frozenset(dirs)


def _without_code_blocks(text: str) -> str:
    """The text with fenced code blocks blanked (their lines kept, so line numbers hold)."""
    out, fence = [], ""
    for line in text.split("\n"):
        m = re.match(r" {0,3}(`{3,}|~{3,})(.*)$", line)
        if not fence and m and not (m.group(1)[0] == "`" and "`" in m.group(2)):  # CommonMark's opening fence
            fence = m.group(1)
            out.append("")
        elif fence and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            fence = ""
            out.append("")
        else:
            out.append("" if fence else line)
    return "\n".join(out)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    text = text.lower()
    text = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _without_code_blocks(path.read_text()).split("\n"):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(out)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _links(path: Path):
    for lineno, line in enumerate(_without_code_blocks(path.read_text()).split("\n"), 1):
        line = re.sub(r"`[^`]*`", "", line)
        for m in LINK.finditer(line):
            yield lineno, m.group(1)


def test_github_slug_rules():
    assert github_slug("Object store layout (the contract between planes)") == \
        "object-store-layout-the-contract-between-planes"
    assert github_slug("The launch article's run: `echo2 plan --workload echo2-paper-30b`") == \
        "the-launch-articles-run-echo2-plan---workload-echo2-paper-30b"
    assert github_slug("Where target A's time goes, hop by hop (2026-12-03)") == \
        "where-target-as-time-goes-hop-by-hop-2026-12-03"


def test_every_relative_link_points_at_a_file_and_a_heading():
    bad = []
    for doc in _docs():
        for lineno, target in _links(doc):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            where = f"{doc.relative_to(REPO)}:{lineno}: {target}"
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                bad.append(f"{where} (no such file)")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no such heading in {dest.relative_to(REPO)})")
    assert not bad, "broken links:\n" + "\n".join(bad)


# a path the text names: a/b/c.ext or a bare name.py / NAME.md; placeholders (<run>, {x}, *, NAME, ...) are skipped
PATH = re.compile(r"(?<![\w./~$-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:py|md|yaml|yml|toml|csv)|(?:[\w.-]+/)+)(?![\w/(-])")
PLACEHOLDER = re.compile(r"[<>{}*]|\.\.\.|\bNAME\b|\bFILE\b|\bRUN\b")
# names of things outside this repository that look like paths: generic file names, other projects' files (by
# their package's folder), a user's own package in an example, an example file name in an error message, and
# the throwaway script a run log quotes (docs/runs/2026-12-04-poker.md: it was never part of the repository)
FOREIGN = {"setup.py", "conftest.py", "__init__.py", "__main__.py", "sup.py"}
FOREIGN_ROOTS = {"vllm", "sky", "s3fs", "botocore", "boto3", "torch", "transformers", "prefect", "pokerkit", "typer",
                 "fsspec", "my_pkg", "site-packages"}
EXAMPLE_NAMES = {"configs/x.yaml", "configs/y.yaml",
                 "echo2/_infra/"}  # infra/ as a wheel holds it (setup.py's package echo2._infra), never in a checkout


def _path_tokens(text: str):
    for lineno, line in enumerate(text.split("\n"), 1):
        for m in PATH.finditer(line):
            token = m.group(1)
            if "://" in line[max(0, m.start() - 12):m.start() + 3]:
                continue
            yield lineno, token


def _missing(token: str) -> bool:
    files, dirs = _repo_files()
    token = token.rstrip(".")
    if token.startswith("./"):
        token = token[2:]
    first = token.split("/", 1)[0]
    if first in FOREIGN_ROOTS or token in EXAMPLE_NAMES:
        return False
    if token.endswith("/"):
        name = token.rstrip("/")
        if first in TOP_DIRS:
            return name not in dirs and name not in files
        # a relative folder: the run layout's (rollouts/, ledger/...) are not the repo's; one that starts at a
        # package's folder (fleet/prices/) or is spelled like one (price_sources/) must be a folder here
        packages = {d.rsplit("/", 1)[-1] for d in dirs if d.startswith("echo2/")}
        if first in packages or "_" in first:
            return not any(d == name or d.endswith("/" + name) for d in dirs)
        return False
    if first in TOP_DIRS and "/" in token:
        return token not in files
    if token in FOREIGN:
        return False
    if token.endswith(".py"):  # relative to some package (data/layout.py) or bare (loss.py)
        return not any(f == token or f.endswith("/" + token) for f in files)
    if "/" not in token and token.endswith(".md") and token[:1].isupper():  # README.md, DESIGN.md
        return not any(f == token or f.endswith("/" + token) for f in files)
    return False


def _comments_and_strings(path: Path) -> str:
    """A module's docstrings, comments and strings (help texts among them), one per line as in the file."""
    import io
    import tokenize

    lines = path.read_text().split("\n")
    keep = [""] * len(lines)
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for row in range(tok.start[0], tok.end[0] + 1):
                keep[row - 1] = lines[row - 1]
    return "\n".join(keep)


def test_docs_and_docstrings_name_only_paths_that_exist():
    bad = []
    for doc in _docs():
        text = re.sub(r"\]\([^)]*\)", "]()", doc.read_text())  # link targets: the link test's
        for lineno, token in _path_tokens(text):
            if not PLACEHOLDER.search(token) and _missing(token):
                bad.append(f"{doc.relative_to(REPO)}:{lineno}: {token}")
    for src in _sources():
        for lineno, token in _path_tokens(_comments_and_strings(src)):
            if not PLACEHOLDER.search(token) and _missing(token):
                bad.append(f"{src.relative_to(REPO)}:{lineno}: {token}")
    assert not bad, "paths named that do not exist:\n" + "\n".join(bad)


def test_readme_is_a_front_door():
    """Under 250 lines, and no test counts or dated timings: those belong in docs/benchmarks.md or docs/runs/."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) < 250
    assert not re.search(r"\b\d+ (passed|failed|skipped)\b|\breal \d+m|\b\d+m\d+s\b", text)


def _readme_commands() -> dict[str, set[str]]:
    """The README's "Command line" block: each `echo2 NAME [SUB|SUB...]` line."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Command line", 1)[1]
    block = section.split("```", 2)[1]
    out: dict[str, set[str]] = {}
    for line in block.splitlines():
        m = re.match(r"echo2 ([a-z][\w-]*)(?: ([a-z][\w|-]*))?", line.strip())
        if not m:
            continue
        subs = out.setdefault(m.group(1), set())
        if m.group(2) and m.group(1) in _groups():
            subs.update(m.group(2).split("|"))
    return out


@lru_cache(maxsize=None)
def _groups() -> dict[str, set[str]]:
    """The typer app's commands: {name: its subcommands (empty for a plain command)}."""
    import typer

    from echo2.cli import app

    root = typer.main.get_command(app)
    out = {}
    for name, cmd in root.commands.items():
        out[name] = set(getattr(cmd, "commands", {}))  # a group (typer's own click) has subcommands
    return out


def test_readme_command_list_is_the_cli():
    assert _readme_commands() == _groups()


def _makefile_benchmarks() -> list[str]:
    names = []
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"BENCHMARKS\s*(?::=|\+=|=)\s*(.*)$", line)
        if m:
            names += m.group(1).split()
    return names


# `echo2 bench` commands that are not benchmarks `make bench` runs: gpu-check checks the learner on a GPU once
# (docs/learner.md, "The GPU check") and needs one unless told `--tiny --device cpu`; machine writes this
# machine's profile for `echo2 plan --from-run --machine`, an input to a plan rather than a side-by-side ratio
NOT_IN_MAKE_BENCH = {"gpu-check", "machine"}


def test_makefile_benchmarks_are_the_bench_commands():
    names = _makefile_benchmarks()
    if not names:
        pytest.skip("the Makefile has no BENCHMARKS")
    # NAME-FLAG runs `echo2 bench NAME --FLAG` (the Makefile's own rule)
    assert {n.split("-", 1)[0] for n in names} == _groups()["bench"] - NOT_IN_MAKE_BENCH
    import typer

    from echo2.cli.bench import bench_app

    bench = typer.main.get_command(bench_app)
    for name in names:
        command, _, flag = name.partition("-")
        if flag:
            opts = {o for p in bench.commands[command].params for o in getattr(p, "opts", [])}
            assert f"--{flag}" in opts, f"Makefile's {name}: `echo2 bench {command}` has no --{flag}"


def test_tests_mirror_the_packages():
    """tests/README.md's layout: every test file is in tests/unit/<an echo2 package, or core>/ or, with an e2e
    mark, in tests/e2e/ (and only then); support/ holds the rest; no two modules share a name (pytest imports
    each by its name)."""
    import ast

    tests = REPO / "tests"
    packages = {p.name for p in (REPO / "echo2").iterdir() if (p / "__init__.py").exists()} | {"core"}
    assert {p.name for p in (tests / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"} <= packages
    names, bad = [], []
    for path in sorted(tests.rglob("*.py")):
        where = path.relative_to(tests).parts
        if where[0] in ("plugins", "fixtures") or "__pycache__" in where or where == ("conftest.py",):
            continue
        names.append(path.name)
        if not path.name.startswith("test_"):
            if where[0] != "support" or len(where) != 2:
                bad.append(f"{path.relative_to(REPO)}: not a test file, outside tests/support/")
            continue
        tree = ast.parse(path.read_text())
        e2e = any(isinstance(n, ast.Attribute) and n.attr == "e2e" and isinstance(n.value, ast.Attribute)
                  and n.value.attr == "mark" for n in ast.walk(tree))
        if e2e != (where[0] == "e2e" and len(where) == 2) or not e2e and not (where[0] == "unit" and len(where) == 3):
            bad.append(f"{path.relative_to(REPO)}: {'has' if e2e else 'has no'} e2e mark")
    assert not bad, "\n".join(bad)
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
