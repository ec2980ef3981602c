"""Local backend: each actor is an OS process (``echo2 actor``) on this machine, plus a reclaim
injector that plays a spot market (the chaos source for tests and demos).

Children get PR_SET_PDEATHSIG on Linux, so an actor dies with a learner killed by SIGKILL, and
they also watch their parent pid; except with a spot learner (``learner.market: spot``, the launch
context's ``outlive_learner``): then an actor runs in a session of its own, without either, so that it
outlives a learner whose whole process tree was killed, and the relaunched learner adopts it (``adopt``:
the ledger's launch event names its pid and this machine's boot id; the process under that pid must be
alive, not a zombie, and its command line must name this run's store and the actor's id, so a pid reused
by another process is never taken). An adopted actor is not this process's child: its exit code cannot be
read, so it ends as "exited" (a crash looks like an exit), and it is stopped by signals to its pid. The actors of
a spot learner that are not adopted (adoption off, or refused) would run on unmanaged: ``release_leftovers`` finds
each on this machine by its command line (``--actor-id ID``, and ``--run`` the run's store where known) and stops
it as ``terminate`` does (SIGTERM, then SIGKILL after the grace).

Secrets reach the child through its environment only (never argv, never the store), and never the
learner's signing key, even one our own environment holds.

Not a trust boundary: local actors run as the learner's user on the learner's machine, so they could
read whatever it can (its key folder included); an actor that must not be trusted runs elsewhere
(SkyPilot, with scoped credentials). Still, an actor gets only the environment it needs
(``actor_environment``): the system's basics, its libraries' settings (Hugging Face, torch, CUDA,
vLLM, locale), the ``ECHO2_*`` settings it reads, the credentials of its store's own cloud (``AWS_*``
for an s3:// store and none for a local one), then its launch's env and secrets. Nothing that looks
secret otherwise (``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*_KEY*`` ...): not the operator's other
cloud keys, not ``ECHO2_SECRETS`` (where the learner keeps run keys) or ``ECHO2_RUN_KEY``.

Reclaims (``fleet.reclaim_rate`` > 0): a Poisson process, ``reclaim_rate`` reclaims per actor
per minute; each reclaim takes one running actor, and with probability ``reclaim_burst`` every
other running actor at the same moment too (spot pools are reclaimed in bursts). A reclaimed actor
gets SIGTERM (the notice: it stops taking work and commits or drops its batch), then SIGKILL after
``notice_s`` if it is still there. ``poll`` reports it as reclaimed, whatever its exit code, and
the manager replaces it. The injector starts with the backend (``start``), not when it is built.

Offers: this machine, free, or each actor priced as one of the catalog offers ``fleet.price_as`` names
(``echo2/fleet/backends/offers.py``). Launch: ``python -m echo2.cli actor --run ... --actor-id ... --parent-pid ...``
under ``fleet.actor_python`` (or the run's ``actor_command``), the store options in its environment (the
learner's own store, on its own machine) and its relay secrets, valid ``LOCAL_TOKEN_S``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from echo2.config import LocalFleetConfig
from echo2.data.site import site_name
from echo2.fleet.backends.base import (
    ActorLaunch,
    ActorOffer,
    ActorState,
    ActorStatus,
    AdoptError,
    FleetBackend,
    LaunchContext,
)
from echo2.fleet.backends.offers import local_offers

log = logging.getLogger("echo2.fleet")

LOCAL_TOKEN_S = 30 * 86400.0
"""Lifetime of a local actor's relay token: it dies with the learner; revocation covers the rest."""

ACTOR_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE", "TMPDIR", "TEMP", "TMP",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV",
    "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"})
"""What a local actor's process gets of the learner's environment by name (the system's basics)."""
ACTOR_ENV_PREFIXES = ("LC_", "XDG_", "ECHO2_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "CUDA_",
                      "NVIDIA_", "OMP_", "MKL_", "OPENBLAS_", "VLLM_")
"""... and by prefix: locale, its libraries' settings (caches, offline mode, threads, devices), echo2's own."""
SECRET_MARKS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "PRIVATE", "_KEY", "KEY_", "AUTH")
"""A name holding one of these is left out, whatever list it is on (``HF_TOKEN``, ``ECHO2_RUN_KEY``,
``ECHO2_SECRETS``), unless it is a credential of the store's own cloud."""
STORE_CREDENTIAL_PREFIXES = {"s3": ("AWS_",), "gs": ("GOOGLE_", "GCLOUD_", "CLOUDSDK_"),
                             "gcs": ("GOOGLE_", "GCLOUD_", "CLOUDSDK_"), "az": ("AZURE_",), "abfs": ("AZURE_",)}
"""The environment a store's client reads its credentials from, by the store URL's scheme."""


def actor_environment(environ: dict[str, str], spec: ActorLaunch) -> dict[str, str]:
    """What a local actor's process is started with (see the module docstring)."""
    scheme = spec.run_url.split("://", 1)[0].lower() if "://" in spec.run_url else "file"
    store_prefixes = STORE_CREDENTIAL_PREFIXES.get(scheme, ())
    env = {}
    for name, value in environ.items():
        upper = name.upper()
        if upper.startswith(store_prefixes):
            env[name] = value
        elif ((name in ACTOR_ENV_NAMES or upper.startswith(ACTOR_ENV_PREFIXES))
              and not any(mark in upper for mark in SECRET_MARKS)):
            env[name] = value
    return {**env, **spec.env, **spec.secrets}


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the actor's own parent-pid watch still applies


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This machine's boot id (Linux): a pid means the same process only within one boot of one machine."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 :][:1] in ("Z", "X")


class AdoptedProcess:
    """An actor process a previous learner started (not our child): the ``Popen`` calls the backend uses,
    from its pid and ``/proc``. ``poll`` answers ``UNKNOWN`` once it ended (its exit code went to its old parent,
    or to init)."""

    UNKNOWN = -1_000_000

    def __init__(self, pid: int, actor_id: str, run_url: str | None):
        self.pid = pid
        self.actor_id = actor_id
        self.run_url = run_url
        self.returncode: int | None = None

    def unreachable(self) -> str | None:
        """Why the process under ``pid`` is not this run's actor ``actor_id`` now (None: it is, and alive)."""
        argv = _cmdline(self.pid)
        if argv is None or _zombie(self.pid):
            return f"pid {self.pid} is gone"
        if not _follows(argv, "--actor-id", self.actor_id) or (
                self.run_url is not None and not _follows(argv, "--run", self.run_url)):
            return f"pid {self.pid} is another process now ({' '.join(argv)[:200]})"
        return None

    def poll(self) -> int | None:
        if self.returncode is None and self.unreachable():
            self.returncode = self.UNKNOWN
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _pids() -> list[int]:
    """The pids of this machine's processes (Linux ``/proc``; none elsewhere)."""
    try:
        return sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    except OSError:
        return []


def _follows(argv: list[str], flag: str, value: str) -> bool:
    return any(a == flag and b == value for a, b in zip(argv, argv[1:]))


def _site_env(offer: ActorOffer | None) -> dict[str, str]:
    """$ECHO2_SITE: the actor's site as the ledger places it (the offer; an unpriced actor has none, so no site),
    where a version not yet planned for it is fetched from a leaf (``topology.guest_sources``)."""
    return {} if offer is None else {"ECHO2_SITE": site_name(offer.provider, offer.region)}


class LocalBackend(FleetBackend):
    name = "local"

    def __init__(self, config: LocalFleetConfig, log_dir: Path, *, seed: int = 0):
        self.config = config
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen | AdoptedProcess] = {}
        self.logs: dict[str, Path] = {}
        self.reclaimed: set[str] = set()
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()
        self.seed = seed
        self._stop = threading.Event()
        self._injector: threading.Thread | None = None
        self._run_url: str | None = None
        """The run's store as actors are told it (from the launch context, once a launch or adoption saw it)."""

    def offers(self, model_params_b: float | None, active_params_b: float | None = None) -> list[ActorOffer] | None:
        return local_offers(self.config, model_params_b, active_params_b)

    def launch_spec(self, actor_id: str, offer: ActorOffer, launch: LaunchContext) -> ActorLaunch:
        self._run_url = launch.store_url
        command = launch.actor_command or [self.config.actor_python or sys.executable, "-m", "echo2.cli", "actor"]
        parent = [] if launch.outlive_learner else ["--parent-pid", str(os.getpid())]
        return ActorLaunch(actor_id=actor_id, run_url=launch.store_url,
                           command=[*command, "--run", launch.store_url, "--actor-id", actor_id, *parent],
                           env={"ECHO2_STORE_OPTIONS": json.dumps(launch.store_options), **_site_env(offer)},
                           offer=offer,
                           secrets=launch.relay_secrets(actor_id, time.time() + LOCAL_TOKEN_S))

    def start(self) -> None:
        if self.config.reclaim_rate > 0 and self._injector is None:
            self._injector = threading.Thread(target=self._reclaim_loop, args=(random.Random(self.seed),),
                                              name="echo2-reclaim-injector", daemon=True)
            self._injector.start()

    def launch(self, spec: ActorLaunch) -> dict:
        self.start()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.actor_id}.log"
        env = actor_environment(dict(os.environ), spec)
        outlive = "--parent-pid" not in spec.command  # a spot learner's actor (launch_spec)
        with open(log_path, "ab") as out:
            if outlive:  # its own session: a kill of the learner's process group or tree does not reach it
                proc = subprocess.Popen(spec.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, start_new_session=True)
            else:
                proc = subprocess.Popen(spec.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env,
                                        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        with self._lock:
            self.procs[spec.actor_id] = proc
            self.logs[spec.actor_id] = log_path
        log.info("launched %s (pid %d), log %s", spec.actor_id, proc.pid, log_path)
        return {"pid": proc.pid, "log": str(log_path), "host": socket.gethostname(), "boot_id": boot_id(),
                "outlives_learner": outlive,
                "marker": ["--run", spec.run_url, "--actor-id", spec.actor_id]}

    def adopt(self, actor_id: str, launched: dict, launch: LaunchContext | None, offer: ActorOffer) -> str:
        """Take over a live actor of this run that the previous learner launched (see the module docstring)."""
        pid, boot = launched.get("pid"), launched.get("boot_id")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
            raise AdoptError("its launch event names no pid")
        if boot is None or boot != boot_id():
            raise AdoptError(f"launched on another machine or boot ({boot}, this one is {boot_id()})")
        run_url = launch.store_url if launch is not None else None
        self._run_url = run_url or self._run_url
        handle = AdoptedProcess(pid, actor_id, run_url)
        why = handle.unreachable()
        if why:
            raise AdoptError(why)
        log_path = Path(str(launched.get("log") or self.log_dir / f"{actor_id}.log"))
        with self._lock:
            self.procs[actor_id] = handle
            self.logs[actor_id] = log_path
        try:
            self._offsets[actor_id] = log_path.stat().st_size  # its lines before now were the old learner's
        except OSError:
            self._offsets[actor_id] = 0
        log.info("adopted %s (pid %d), log %s", actor_id, pid, log_path)
        return "pid"

    def poll(self, actor_id: str) -> ActorStatus:
        proc = self.procs[actor_id]
        code = proc.poll()
        if code is None:
            return ActorStatus(ActorState.RUNNING)
        if actor_id in self.reclaimed:
            return ActorStatus(ActorState.RECLAIMED, f"reclaim injector (exit code {code})")
        if code is AdoptedProcess.UNKNOWN:
            return ActorStatus(ActorState.EXITED, "adopted process ended (its exit code is its old parent's)")
        if code == 0:
            return ActorStatus(ActorState.EXITED, "exit code 0")
        return ActorStatus(ActorState.CRASHED, f"exit code {code}, log {self.logs[actor_id]}")

    def release_leftovers(self, actor_ids: list[str], grace_s: float = 10.0) -> None:
        """Stop the actors a previous learner of this run left running and this one did not adopt: each live process
        of this machine whose command line names one of ``actor_ids`` after ``--actor-id`` (and the run's store after
        ``--run``, where known) gets SIGTERM, then SIGKILL after ``grace_s``."""
        wanted = set(actor_ids)
        if not wanted:
            return
        found = []
        for pid in _pids():
            argv = _cmdline(pid)
            if not argv or pid == os.getpid() or _zombie(pid):
                continue
            actor_id = next((a for a in wanted if _follows(argv, "--actor-id", a)), None)
            if actor_id is None or (self._run_url is not None and not _follows(argv, "--run", self._run_url)):
                continue
            handle = AdoptedProcess(pid, actor_id, self._run_url)
            log.warning("stopping %s (pid %d): left running by the previous learner, not adopted", actor_id, pid)
            handle.send_signal(signal.SIGTERM)
            found.append(handle)
        for handle in found:
            try:
                handle.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                handle.kill()

    def terminate(self, actor_id: str, grace_s: float = 10.0) -> None:
        proc = self.procs[actor_id]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def new_log_lines(self, actor_id: str) -> list[str]:
        path = self.logs.get(actor_id)
        if path is None:
            return []
        offset = self._offsets.get(actor_id, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self._offsets[actor_id] = offset + len(complete)
        return [line for line in complete.decode(errors="replace").splitlines() if line]

    def close(self) -> None:
        self._stop.set()
        if self._injector is not None:
            self._injector.join(timeout=5)

    # -- the reclaim injector ------------------------------------------------------------------
    def _running(self) -> list[str]:
        with self._lock:
            return [a for a, p in self.procs.items() if p.poll() is None and a not in self.reclaimed]

    def _reclaim_loop(self, rng: random.Random) -> None:
        per_second = self.config.reclaim_rate / 60.0
        while not self._stop.is_set():
            running = self._running()
            # next reclaim of the fleet as it is now; re-drawn every second so the rate follows its size
            if not running or rng.random() > 1 - pow(2.718281828459045, -per_second * len(running)):
                self._stop.wait(1.0)
                continue
            victims = running if rng.random() < self.config.reclaim_burst else [rng.choice(running)]
            for actor_id in victims:
                self._reclaim(actor_id)
            self._stop.wait(1.0)

    def _reclaim(self, actor_id: str) -> None:
        proc = self.procs[actor_id]
        self.reclaimed.add(actor_id)
        log.warning("reclaim injector: reclaiming %s (notice %.0fs)", actor_id, self.config.notice_s)
        proc.send_signal(signal.SIGTERM)

        def kill_after_notice():
            try:
                proc.wait(timeout=self.config.notice_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        threading.Thread(target=kill_after_notice, daemon=True).start()
