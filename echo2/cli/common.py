"""What every command of the CLI shares: the one-line failure (exit 2), the set-up of a process that runs the
flow (Ctrl-C and SIGTERM, Prefect's settings), logging, and the store options the fleet passes to an actor.

Imports no plane of echo2 and nothing heavy at module level: an actor's ``echo2`` loads this too."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import NoReturn

import typer

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "echo2",
    # the fleet's background threads (reclaim injector, SkyPilot launches) log outside the flow run's
    # context: to the console only, without a warning per line
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}

LEARNER_EXTRA = ("prefect", "tensorboard", "matplotlib")


def fail(message: str, code: int = 2) -> NoReturn:
    """Bad input (config, model, store, options): one line on stderr, exit 2 (or ``code``)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


class CtrlC:
    """Whether the user pressed Ctrl-C, or the process got SIGTERM (``kill``, a supervisor, a CI job's
    timeout): both stop the run the same way. Prefect can turn the KeyboardInterrupt into another
    error (a ValueError when it lands while a task run is being created), so the exception alone
    cannot tell. During a flow run Prefect puts its own SIGTERM handler in place (it marks the flow
    run crashed, then sends the signal again to the handler it replaced: this one). Inside a learner's
    step the handler runs only at the step's safe points, or once its version has moved
    (``learner/notice.py``, "Safe points"), so a stop never lands inside an optimizer update."""

    pressed = False
    signum = signal.SIGINT

    @classmethod
    def handler(cls, signum, frame) -> None:
        cls.pressed, cls.signum = True, signum
        raise KeyboardInterrupt

    @classmethod
    def install(cls) -> None:
        """Ctrl-C (SIGINT) and SIGTERM stop the run cleanly (checkpoint, actors stopped, Prefect's
        temporary server stopped at exit; exit 130 or 143) however we were started: a shell script
        that puts a job in the background makes it inherit SIGINT ignored, and the default action of
        SIGTERM would end this process without a word, leaving Prefect's server behind."""
        cls.pressed, cls.signum = False, signal.SIGINT
        signal.signal(signal.SIGINT, cls.handler)
        signal.signal(signal.SIGTERM, cls.handler)

    @classmethod
    def exit_code(cls) -> int:
        return 128 + int(cls.signum)


def prepare_flow_process(verbose: bool) -> None:
    """A process about to run the echo2-train flow (``echo2 run``, rank 0 of ``echo2 learner``): Ctrl-C and
    SIGTERM stop it cleanly (``CtrlC``), and Prefect's settings default to ours (a setting in the environment
    wins); Prefect's own logs only with ``--verbose``."""
    CtrlC.install()
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def need_learner_extra(what: str) -> None:
    """One line, exit 2, where the learner's packages are missing (an actor-only install)."""
    import importlib.util

    missing = [name for name in LEARNER_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        fail(f"{what} needs the learner extra ({', '.join(missing)} not installed): pip install 'echo2[learner]'")


def store_options_from_env() -> dict:
    """The store's fsspec options (endpoint, credentials) from ``ECHO2_STORE_OPTIONS``: how the fleet hands them
    to an actor, and how ``export``, ``eval``, ``report`` and ``audit`` are given them."""
    raw = os.environ.get("ECHO2_STORE_OPTIONS")
    return json.loads(raw) if raw else {}


def quiet_bars_when_piped(stdout=None, stderr=None) -> bool:
    """No third-party progress bars (tqdm's, huggingface_hub's, transformers': the GGUF conversion, "Loading
    weights", downloads) unless both stdout and stderr are terminals: in a file or a pipe a bar is a run of
    carriage returns that buries the lines around it. Environment variables, so that libraries imported later and
    the processes this one starts (actors, torchrun's ranks) read them too; a user's own setting stands. Returns
    whether bars were turned off."""
    if _isatty(sys.stdout if stdout is None else stdout) and _isatty(sys.stderr if stderr is None else stderr):
        return False
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":  # already imported: they read the variable at import
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
    return True


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would tear the progress display
    hf_logging.set_verbosity_error()


def setup_logging(verbose: bool, console=None) -> None:
    """Logs through rich beside the progress bar (``console``), or, without one (output to a file
    or a pipe), as plain timestamped lines on stderr."""
    quiet_transformers()
    if console is not None:
        from rich.logging import RichHandler

        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], format="%(message)s", force=True)
    logging.getLogger("echo2").setLevel(logging.DEBUG if verbose else logging.INFO)
