"""``echo2 config schema`` and ``echo2 config show``: the config's JSON schema (for an editor) and a config file as
it resolves (its ``base:`` files, ``ECHO2_SET__`` variables and ``--set`` overrides applied), without touching a
store or a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from echo2.cli.common import fail
from echo2.errors import Echo2InputError

config_app = typer.Typer(no_args_is_help=True, help="The run config: its JSON schema, a file as it resolves.")


@config_app.command("schema")
def schema(
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write it to this file instead of stdout."),
) -> None:
    """Print the JSON schema of a config file. An editor's YAML language server checks and completes a config
    with it: first line `# yaml-language-server: $schema=PATH` (docs/configuration.md)."""
    from echo2.config import config_schema

    text = json.dumps(config_schema(), indent=1) + "\n"
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)


@config_app.command("show")
def show(
    config: Optional[Path] = typer.Argument(None, help="YAML config (none: the defaults)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: --set train.lr=1e-5 (repeatable)."),
) -> None:
    """Print the resolved config: every field, after base files, ECHO2_SET__ variables and --set."""
    from echo2.config import dump_config, load_config

    try:
        cfg = load_config(config, set_ or [])
    except Echo2InputError as exc:
        fail(str(exc))
    typer.echo(dump_config(cfg), nl=False)
