"""What every chaos scenario uses: a tiny model, real ``echo2 run`` processes, the ledger audit, a moto
S3 server on loopback, and the grep for secrets.

A run is the real CLI (``python -m echo2.cli run``) in a session of its own, its output in a file (a
pipe would stay open in what a SIGKILLed learner leaves behind), reaped as a group afterwards. Every
scenario works in its own folder; ``PREFECT_HOME`` and the secrets folder live there too, so that the
grep sees all a run wrote: the store, the logs, Prefect's database (parameters, artifacts, logs).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The source checkout: the chaos suite runs from one (its runs read configs/, which no wheel ships), unlike
the shipped files of infra/ (echo2.shipped)."""
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
TINY = ["rollout.group_size=4", "rollout.groups_per_batch=2", "train.groups_per_step=2", "rollout.max_new_tokens=6",
        "eval.max_new_tokens=6", "task.eval_size=10", "train.lr=1e-3", "eval.before=false", "eval.after=false",
        "train.checkpoint_every=2", "train.keep_checkpoints=2"]
"""The quickstart shrunk to the tiny model: a step takes well under a second of compute."""


_MAKING_MODELS = threading.Lock()


def tiny_model(folder: Path) -> Path:
    """The tiny model in ``folder``, made once (one at a time: scenarios run side by side, and making one
    seeds torch's global generator)."""
    from echo2.bench.tiny_model import make_tiny_model

    model = folder / "tiny-model"
    with _MAKING_MODELS:
        if not (model / "config.json").exists():
            make_tiny_model(model)
    return model


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def environment(workdir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ECHO2_FAILPOINTS", "ECHO2_RUN_KEY")}
    env.update(PREFECT_HOME=str(workdir / "prefect-home"), ECHO2_SECRETS=str(workdir / "secrets"),
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", AWS_EC2_METADATA_DISABLED="true", HF_HUB_OFFLINE="1")
    env.update(extra)
    return env


STOP = threading.Event()
"""Set when the suite is interrupted (Ctrl-C): scenarios running in other threads stop their runs."""


class Stopped(Exception):
    """The suite was interrupted while this scenario ran."""


def run_cli(args: list[str], workdir: Path, log: Path, *, env: dict | None = None, timeout: float = 900.0,
            while_running=None) -> int:
    """``python -m echo2.cli ARGS`` to completion (or ``timeout``); its exit code. ``while_running(proc)`` is
    called every half second while it runs (a scenario's injector). Raises ``Stopped`` once ``STOP`` is set
    (its run killed with its whole session)."""
    if STOP.is_set():
        raise Stopped("interrupted")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "echo2.cli", *args], cwd=REPO, env=env or environment(workdir),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        try:
            while proc.poll() is None and time.time() < deadline and not STOP.is_set():
                if while_running is not None:
                    while_running(proc)
                time.sleep(0.5)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        finally:
            reap(proc)
    if STOP.is_set():
        raise Stopped("interrupted")
    return proc.returncode


def reap(proc) -> None:
    """SIGKILL what is left of a process's session (Prefect's ephemeral server outlives a killed learner)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def audit(run_dir: str) -> dict:
    """``echo2 audit RUN --json`` (the real CLI)."""
    proc = subprocess.run([sys.executable, "-m", "echo2.cli", "audit", run_dir, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    return json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {"error": proc.stderr[-500:]}


def lost(result: dict) -> int:
    """Rollout files lost or used twice (what the suite fails on)."""
    return int(result.get("lost", 0)) + int(result.get("used_twice", 0)) if "error" not in result else -1


def grep(paths: list[Path], needles: list[str]) -> list[str]:
    """Files at or under ``paths`` that hold any of ``needles`` (as bytes), as 'path: needle[:8]...'."""
    found = []
    wanted = [n.encode() for n in needles if n and len(n) >= 6]
    files = [f for p in paths if p.exists() for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    for path in files:
        if path.stat().st_size > 256 * 2**20:
            continue
        data = path.read_bytes()
        for needle in wanted:
            if needle in data:
                found.append(f"{path}: {needle[:8].decode(errors='replace')}...")
    return found


def run_secrets(workdir: Path) -> list[str]:
    """What must never leave the learner: every run key's seed (the secrets folder); relay tokens and TLS
    bundles are recognised by their form instead (``TOKEN_MARKS``)."""
    secrets = []
    for key_file in (workdir / "secrets").glob("*.key"):
        secrets.append(key_file.read_text().strip())
    return secrets


TOKEN_MARKS = ["e2rt1.", "e2rc1.", "BEGIN PRIVATE KEY", "BEGIN EC PRIVATE KEY"]
"""Forms of the per-actor secrets: a relay token, a TLS bundle (certificate and key), a PEM private key."""


def leaks(workdir: Path, stores: list[Path], extra: list[str] = ()) -> list[str]:
    """Where the run key, a relay token, a TLS key or ``extra`` secrets were written: the store, the logs,
    Prefect's home (its database holds flow parameters, artifacts and logs)."""
    return grep([*stores, workdir / "prefect-home", *workdir.glob("*.log")],
                [*run_secrets(workdir), *TOKEN_MARKS, *extra])


class MotoServer:
    """moto's S3 (and STS, IAM) on 127.0.0.1, in this process; a bucket made for the scenario."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request, in the table's output
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"

    def bucket(self, name: str, key: str, secret: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id=key,
                     aws_secret_access_key=secret).create_bucket(Bucket=name)

    def stop(self) -> None:
        self.server.stop()
