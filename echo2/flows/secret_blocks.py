"""Secrets from Prefect Secret blocks: a flow run on a worker reads the run's key and the store's keys from its
Prefect server rather than from files on the worker's machine.

echo2 reads its secrets from the environment (``ECHO2_RUN_KEY``: the run's signing key; the store client's own
variables, e.g. ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``). ``ECHO2_SECRET_BLOCKS`` names which of them a Secret
block fills, ``NAME=block-name`` pairs separated by commas; a variable the environment sets already is left as it is
(an operator's explicit value wins). Only names and block names appear in messages, never a value.
"""

from __future__ import annotations

import os
import re

from echo2.errors import Echo2InputError

SECRET_BLOCKS_ENV = "ECHO2_SECRET_BLOCKS"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BLOCK = re.compile(r"^[a-z0-9][a-z0-9-]*$")  # Prefect's block document names: lowercase letters, digits, dashes


def parse_secret_blocks(spec: str) -> dict[str, str]:
    """``NAME=block-name,...`` as {variable: block name}; a malformed pair is an input error, named."""
    pairs = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, block = (s.strip() for s in item.partition("="))
        if not sep or not _NAME.match(name) or not _BLOCK.match(block):
            raise Echo2InputError(f"{SECRET_BLOCKS_ENV}: {item[:80]!r} is not NAME=block-name (a Secret block's name: "
                                  "lowercase letters, digits, dashes)")
        pairs[name] = block
    return pairs


def load_secret_blocks(spec: str | None = None) -> list[str]:
    """Set each variable of ``spec`` (default ``$ECHO2_SECRET_BLOCKS``) that the environment lacks from its Secret
    block; returns the names set. A block that is missing or holds no text stops the flow run, named."""
    pairs = parse_secret_blocks(os.environ.get(SECRET_BLOCKS_ENV, "") if spec is None else spec)
    wanted = {name: block for name, block in pairs.items() if not os.environ.get(name)}
    if not wanted:
        return []
    from prefect.blocks.system import Secret  # only a flow run that names blocks asks its server for them

    for name, block in wanted.items():
        try:
            value = Secret.load(block).get()
        except ValueError as exc:  # Prefect's "Unable to find block document named ..."
            raise Echo2InputError(f"{SECRET_BLOCKS_ENV}: no Secret block {block!r} for {name} on the Prefect server "
                                  f"({type(exc).__name__})") from None
        if not isinstance(value, str) or not value:
            raise Echo2InputError(f"{SECRET_BLOCKS_ENV}: Secret block {block!r} for {name} holds no text")
        os.environ[name] = value
    return sorted(wanted)
