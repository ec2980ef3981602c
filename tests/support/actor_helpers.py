"""A real actor process on a run of the tiny model, for the tests of the actor environment
(``test_actor_env.py``) and of the vLLM engine (``test_vllm_engine.py``, ``make test-vllm``).

``start_actor`` runs ``echo2 actor`` (the CLI entry point, as the fleet does) in a fresh interpreter
where Prefect, the flows and the learner cannot be imported: a meta-path finder refuses them and
prints ``BLOCKED-IMPORT name`` to stderr, so an import that some code would catch still shows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from echo2.config import Config
from echo2.data import layout
from echo2.data.relay_tokens import RELAY_TOKEN_ENV, mint
from echo2.data.run_folder import create_run
from echo2.data.run_key import run_key
from echo2.data.store import ObjectStore, open_store
from echo2.data.weights import model_files, publish_version

BLOCKED = ("prefect", "echo2.flows", "echo2.learner")

_BLOCKER = f"""
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {BLOCKED!r}):
            print("BLOCKED-IMPORT " + name, file=sys.stderr, flush=True)
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: the actor must not import it)")
        return None
sys.meta_path.insert(0, _Refuse())
from echo2.cli import app
app(sys.argv[1:], prog_name="echo2")
"""


def make_run(tmp_path: Path, model_dir: Path, tensors: dict[str, torch.Tensor], config: dict,
             monkeypatch) -> tuple[ObjectStore, object, str]:
    """A run as the learner creates it (run.json with ``config``, the signing key, version 0 of
    ``tensors`` with ``model_dir``'s config and tokenizer files). Returns (store, key, run url)."""
    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    run_id = "r1"
    url = str(tmp_path / "store" / "runs" / run_id)
    store = open_store(url)
    key = run_key(run_id, create=True)
    resolved = Config.model_validate({"run": {"id": run_id}, "broadcast": {"mode": "store"}, **config})
    create_run(store, run_id, resolved.model_dump(mode="json"), key=key, echo2_version="test")
    publish_version(store, 0, tensors, extra_files=model_files(model_dir), shard_mb=64, key=key)
    return store, key, url


def start_actor(url: str, key, actor_id: str, log_path: Path, *, python: str = sys.executable) -> subprocess.Popen:
    """``echo2 actor --run URL --actor-id ID`` with Prefect, the flows and the learner unimportable."""
    env = dict(os.environ, **{RELAY_TOKEN_ENV: mint(key, "r1", actor_id, time.time() + 3600)})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH"))
                                        if p)
    log = open(log_path, "w")
    return subprocess.Popen([python, "-c", _BLOCKER, "actor", "--run", url, "--actor-id", actor_id],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_for_rollouts(store: ObjectStore, version: int, proc: subprocess.Popen, log_path: Path, *,
                      timeout: float) -> list[str]:
    """Keys of the rollout files the actor committed for ``version``, once there is one."""
    deadline = time.time() + timeout
    prefix = layout.rollout_key(version, "x", 0).rsplit("/", 1)[0] + "/"
    while time.time() < deadline:
        keys = [k for k in store.list(prefix) if k.endswith(".arrow")]
        if keys:
            return sorted(keys)
        if proc.poll() is not None:
            raise AssertionError(f"actor exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no rollout of v{version} within {timeout}s:\n{log_path.read_text()[-4000:]}")


def stop_actor(proc: subprocess.Popen, *, timeout: float = 120) -> int:
    """SIGTERM, as the fleet stops an actor; SIGKILL the session if it does not end in ``timeout``."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
