"""Defaults written in brackets in a command's help, e.g. ``[0.95]``, reach the help text: rich reads
``[lowercase...]`` as a style tag and drops it unless it is escaped."""

import re

import pytest
from typer.testing import CliRunner

from echo2.cli import app


def _help(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0, result.output
    return re.sub(r"\s+", " ", result.output.replace("│", " "))


@pytest.mark.parametrize(("command", "defaults"), [
    (("plan",), ["[the FLOP model]", "[0.25]", "[H100]", "[1]", "[64]", "[8]", "[512]", "[2]", "[ceil(R / b)]",
                 "[keyframes + deltas through the relay]", "[2.1%, measured]", "[10 and 1]",
                 "[infra/prices/gpu-offers-2026-11.csv]", "[infra/profiles/rollout-throughput.yaml]", "[0.95]",
                 "[providers.py's table]", "[600]"]),
    (("prices",), ["[infra/prices/gpu-offers-2026-11.csv]", "[the snapshot's]"]),
])
def test_every_default_in_brackets_is_shown(command, defaults):
    text = _help(*command)
    missing = [d for d in defaults if d not in text]
    assert not missing, f"echo2 {' '.join(command)} --help lacks {missing}"
    assert "\\[" not in text  # the escape itself is not shown
