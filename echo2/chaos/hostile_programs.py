"""The hostile programs the code task's sandbox must hold: what a policy's code may try on an actor or the learner.

Each is a Python program, run as a program of its own (``Sandbox.run``, ``tests/e2e/test_sandbox.py``) or as the code of
a reply that the code task loads in its harness (the ``hostile-code`` chaos row), where its top level runs when it
loads. It reports what it managed with ``os.write(1, ...)`` (the harness silences ``print``, not the file
descriptor), so the caller can read whether it got anywhere:

    fork-bomb       forks without end; every child execs a sleeper that carries ``mark`` in its argv
    spin            execs a busy loop that carries ``mark``
    allocate        asks for 10 GB at once
    write-outside   writes ``outside`` (a file of the caller's, its folder writable to the caller), /etc, /, the
                    interpreter's folder, /root; "WROTE <path>" for each that worked
    read-keys       reads ``key_file`` and lists its folder and ~/.config/echo2/keys; "READ <text>" for what it got
    read-env        prints its environment and every /proc/*/environ it can read
    connect         connects to 127.0.0.1:``port`` (a socket the caller listens on) and sends ``mark``; "REACHED"
    print-gigabyte  writes 1 GB to stdout
    setsid-sleep    a child leaves the session (``os.setsid``) and sleeps past any limit as a process carrying
                    ``mark``; the parent sleeps too
    kill-parent     SIGKILLs its parent, process 1 of its namespace and every process it may signal, then sleeps
                    as a process carrying ``mark``

``leftovers(mark)`` lists the processes of this machine that still carry the mark (argv or environment).
"""

from __future__ import annotations

import os
from pathlib import Path

_SLEEPER = "import time\\nwhile True: time.sleep(1)"

_PROGRAMS = {
    "fork-bomb": '''import os, sys
while True:
    try:
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "{sleeper}", "{mark}"])
    except OSError:
        pass
''',
    "spin": '''import os, sys
os.execv(sys.executable, [sys.executable, "-c", "while True: pass", "{mark}"])
''',
    "allocate": '''import os
block = bytearray(10 * 2**30)
os.write(1, b"ALLOCATED\\n")
''',
    "write-outside": '''import os, sys
for path in ({outside!r}, "/etc/{mark}", "/{mark}", os.path.join(sys.prefix, "{mark}"), "/root/{mark}",
             os.path.expanduser("~/{mark}")):
    try:
        with open(path, "w") as f:
            f.write("{mark}")
        os.write(1, ("WROTE " + path + "\\n").encode())
    except OSError:
        pass
''',
    "read-keys": '''import os
for path in ({key_file!r},):
    try:
        os.write(1, b"READ " + open(path, "rb").read() + b"\\n")
    except OSError:
        pass
for folder in ({key_dir!r}, os.path.expanduser("~/.config/echo2/keys"), "/root/.config/echo2/keys"):
    try:
        for name in os.listdir(folder):
            os.write(1, b"READ " + open(os.path.join(folder, name), "rb").read() + b"\\n")
    except OSError:
        pass
''',
    "read-env": '''import os
os.write(1, repr(dict(os.environ)).encode() + b"\\n")
for pid in os.listdir("/proc"):
    try:
        os.write(1, b"ENV " + open("/proc/" + pid + "/environ", "rb").read() + b"\\n")
    except OSError:
        pass
''',
    "connect": '''import os, socket
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("127.0.0.1", {port}))
    s.sendall(b"{mark}")
    os.write(1, b"REACHED\\n")
except OSError as exc:
    os.write(1, ("UNREACHABLE " + type(exc).__name__ + "\\n").encode())
''',
    "print-gigabyte": '''import os
block = b"x" * 2**20
for _ in range(1024):
    os.write(1, block)
''',
    "setsid-sleep": '''import os, sys, time
if os.fork() == 0:
    os.setsid()
    os.execv(sys.executable, [sys.executable, "-c", "{sleeper}", "{mark}"])
time.sleep(3600)
''',
    "kill-parent": '''import os, signal, sys
for target in (os.getppid(), 1, -1):
    try:
        os.kill(target, signal.SIGKILL)
    except OSError:
        pass
os.execv(sys.executable, [sys.executable, "-c", "{sleeper}", "{mark}"])
''',
}

NAMES = tuple(_PROGRAMS)


def hostile_programs(*, mark: str, outside: str, key_file: str, port: int) -> dict[str, str]:
    """Every hostile program, by name, aimed at the caller's ``outside`` file, ``key_file`` and ``port``."""
    values = {"mark": mark, "outside": outside, "key_file": key_file, "key_dir": str(Path(key_file).parent),
              "port": port, "sleeper": _SLEEPER}
    return {name: source.format(**values) for name, source in _PROGRAMS.items()}


def leftovers(mark: str) -> list[int]:
    """Processes (but this one) whose argv or environment holds ``mark``."""
    needle, found = mark.encode(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{entry.name}/{part}", "rb") as f:
                    if needle in f.read():
                        found.append(int(entry.name))
                        break
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found
