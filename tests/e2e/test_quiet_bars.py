"""No third-party progress bar in piped output: a bar in a file or a pipe is a run of carriage returns (tqdm's
"Converting and de-quantizing GGUF tensors...", transformers' "Loading weights", huggingface_hub's downloads)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from conftest import REPO

from echo2.cli.common import quiet_bars_when_piped

BAR_SWITCHES = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_are_turned_off_unless_both_streams_are_terminals(monkeypatch):
    for name in BAR_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert not quiet_bars_when_piped(_Terminal(), _Terminal())
    assert not any(name in os.environ for name in BAR_SWITCHES)
    assert quiet_bars_when_piped(_Terminal(), io.StringIO())  # stderr piped: `echo2 run ... 2>&1 | tee log`
    assert all(os.environ[name] == "1" for name in BAR_SWITCHES)


@pytest.mark.e2e
def test_the_embedded_models_conversion_draws_no_bar_into_a_pipe(tmp_path):
    """The quickstart's first run converts the embedded GGUF (a fresh cache here, so it does), loads and saves the
    model: three tqdm bars in a terminal, none through a pipe once the command line is loaded."""
    env = {k: v for k, v in os.environ.items() if k not in BAR_SWITCHES}
    code = ("import echo2.cli\nfrom echo2.models import DEFAULT_MODEL, resolve_model\n"
            "print(resolve_model(DEFAULT_MODEL))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**env, "ECHO2_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "cache" / "models").is_dir()  # the conversion ran
    output = proc.stdout + proc.stderr
    assert "\r" not in output and "%|" not in output, output[-2000:]
