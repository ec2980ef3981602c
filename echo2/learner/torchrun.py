"""Starting the learner's processes with ``torchrun``: on one node, or on several that meet at a rendezvous.

One node (``--nnodes 1``): ``torchrun --standalone --nproc-per-node P``, as before.

Several nodes: every node runs ``echo2 learner CONFIG --nnodes N --node-rank R --rdzv-endpoint HOST:PORT``,
which starts ``torchrun --nnodes N --node-rank R --nproc-per-node P --rdzv-backend static
--rdzv-endpoint HOST:PORT``. The rendezvous is torchrun's *static* one, not c10d: c10d numbers the nodes
in the order they happen to join (``--node-rank`` is ignored), while the learner needs global rank 0 on
node 0, the node whose launcher resolved the run. Under the static rendezvous node R's processes are
global ranks R*P .. R*P+P-1 and node 0 hosts the rendezvous store at HOST:PORT (HOST is node 0's address).
Its ``timeout`` bounds the wait: node 0 gives up when the other nodes have not all joined in time, another
node when it cannot reach the store in time (``Rendezvous.timeout_s``).

A node other than 0 must first be able to reach HOST:PORT: its launcher waits for the port to accept a
connection (node 0 opens it only once it has resolved the run, which may take minutes) for at most the
same timeout, and fails with one line if it never does, before torchrun starts and prints a traceback.

Each node's processes start from a private file (``write_rank_file``, mode 0600) written by that node's
launcher: on node 0 the resolved config of the run, elsewhere the node's own config file with its
overrides, read for ``learner.dist_backend`` and the collective timeout only. The run's config reaches every
rank but 0 over the process group (``distributed.share_config``). The node's first process deletes the file
once the group has formed (``joined``), so a file still there after torchrun failed means the rendezvous
never completed.

What the rendezvous protects, and what not. torchrun's static rendezvous store (a TCPStore on node 0's
HOST:PORT) and the process groups built on it are not authenticated: whoever reaches that port while the nodes meet
can join as a missing rank, and a rank receives whatever rank 0 broadcasts over the group (pickled, so a joiner
posing as rank 0 would also run code in the others). What keeps it closed is the network alone: the port must be
reachable from the learner's nodes only (a security group or firewall rule of their own, never one shared with
actors or other machines; SkyPilot's cluster network does this, ``infra/skypilot/learner.yaml``). What a joiner
would get is bounded: the config rank 0 shares leaves out the store's options (``for_followers``: endpoint,
credentials), since no rank but 0 opens the store, and the run's signing key never crosses the group.

Stopping: torchrun passes a SIGTERM or SIGINT it gets to every rank, then SIGKILLs the ranks still running
after its ``--shutdown-timeout``. Its default, 30 s, is too short for rank 0's final checkpoint (``distributed``:
the followers wait for it); ours is ``STOP_GRACE_S``, or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` where set. torchrun
runs under ``python -m echo2.learner.torchrun``, which exits 128 + the signal's number where torchrun ends with
a traceback for the signal it got (the ranks have been stopped by then).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from echo2.errors import Echo2InputError

DEFAULT_RDZV_TIMEOUT_S = 600.0
"""torchrun's own default for the static rendezvous."""
STOP_GRACE_S = 300
"""Seconds torchrun gives the ranks to end after it passed them SIGTERM or SIGINT: rank 0 finishes the op in
flight, writes its final checkpoint (every rank its shards) and releases the followers."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the nodes of a learner meet; ``nnodes == 1`` is one node on its own (``--standalone``)."""

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    timeout_s: float = DEFAULT_RDZV_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise Echo2InputError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise Echo2InputError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), "
                                  f"got {self.node_rank}")
        if self.timeout_s <= 0:
            raise Echo2InputError(f"--rdzv-timeout must be positive, got {self.timeout_s}")
        if self.nnodes > 1:
            self.host_port()  # one clear error now, not a traceback from torchrun

    def host_port(self) -> tuple[str, int]:
        """(host, port) of ``endpoint``; one clear error unless it reads HOST:PORT."""
        host, sep, port = (self.endpoint or "").rpartition(":")
        host = host.strip("[]")  # [::1]:29500
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise Echo2InputError(f"--rdzv-endpoint must be HOST:PORT on node 0 (e.g. 10.0.0.4:29500) with "
                                  f"--nnodes {self.nnodes}, got {self.endpoint!r}")
        return host, int(port)

    @property
    def leads(self) -> bool:
        """Whether this node holds global rank 0: it resolves the run and runs the flow."""
        return self.node_rank == 0


def torchrun_command(nproc: int, rendezvous: Rendezvous, program: list[str]) -> list[str]:
    """The command that starts this node's ``nproc`` processes, each running ``program`` (what follows
    torchrun's options: ``-m echo2.cli learner --rank-config FILE``, or a script and its arguments)."""
    if rendezvous.nnodes == 1:
        launch = ["--standalone", f"--nproc-per-node={nproc}"]
    else:
        launch = [f"--nnodes={rendezvous.nnodes}", f"--node-rank={rendezvous.node_rank}",
                  f"--nproc-per-node={nproc}", "--rdzv-backend=static", f"--rdzv-endpoint={rendezvous.endpoint}",
                  f"--rdzv-conf=timeout={int(rendezvous.timeout_s)}"]
    grace = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", STOP_GRACE_S))
    return [sys.executable, "-m", "echo2.learner.torchrun", *launch, f"--shutdown-timeout={grace}", *program]


def wait_for_endpoint(rendezvous: Rendezvous) -> None:
    """A node other than 0: wait until node 0's rendezvous port accepts a connection, at most the timeout."""
    host, port = rendezvous.host_port()
    deadline = time.monotonic() + rendezvous.timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, rendezvous.timeout_s)).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RendezvousFailed(f"node {rendezvous.node_rank} of {rendezvous.nnodes} could not reach the "
                                       f"rendezvous at {rendezvous.endpoint} within {rendezvous.timeout_s:.0f} s "
                                       f"({exc.strerror or exc}): start node 0's `echo2 learner --nnodes "
                                       f"{rendezvous.nnodes} --node-rank 0 --rdzv-endpoint {rendezvous.endpoint}` "
                                       "and check that the port is open between the nodes") from None
            time.sleep(0.5)


def never_joined(rendezvous: Rendezvous) -> str:
    """The line a launcher prints when torchrun failed before this node's processes formed the group."""
    if rendezvous.leads:
        return (f"the learner's {rendezvous.nnodes - 1} other node(s) did not all join the rendezvous at "
                f"{rendezvous.endpoint} within {rendezvous.timeout_s:.0f} s: run `echo2 learner CONFIG --nnodes "
                f"{rendezvous.nnodes} --node-rank R --rdzv-endpoint {rendezvous.endpoint}` on each of them")
    return (f"node {rendezvous.node_rank} of {rendezvous.nnodes}: the rendezvous at {rendezvous.endpoint} did not "
            f"complete within {rendezvous.timeout_s:.0f} s (torchrun's output above says why)")


class RendezvousFailed(Echo2InputError):
    """The nodes of a learner did not meet."""


def write_rank_file(data: dict) -> Path:
    """A private file (0600: store options may hold credentials) the node's processes start from."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="echo2-learner-", delete=False) as f:
        os.chmod(f.name, 0o600)
        json.dump(data, f)
    return Path(f.name)


def for_followers(config: dict) -> dict:
    """The run's config as rank 0 shares it with the other ranks (``distributed.share_config``): without the store's
    options, which may hold credentials and which no rank but 0 reads (it alone opens the store)."""
    store = dict(config.get("store") or {})
    store["options"] = {}
    return {**config, "store": store}


def joined(rank_file: Path) -> None:
    """The node's first process, once the group has formed: the file is no longer needed, and its absence
    tells the launcher that the rendezvous completed."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        rank_file.unlink(missing_ok=True)


def prepare_follower_node(config_path: Path, overrides: list[str], node_rank: int, endpoint: str | None,
                          timeout_s: float) -> tuple[int, Rendezvous, Path]:
    """The launcher of node 1..N-1, up to torchrun: (processes on this node, the rendezvous, their start file).
    No run is resolved, created or resumed and the store is never opened: this node's config file (the same
    as node 0's, normally) gives the number of nodes and of processes, what the processes need before the
    group forms (backend, collective timeout) and the model to have ready, converted once here rather than by
    each process at the same time. The run's own config comes from rank 0 (``distributed.share_config``)."""
    from echo2.config import load_config
    from echo2.models import resolve_model

    local = load_config(config_path, overrides)
    rendezvous = Rendezvous(local.learner.nnodes, node_rank, endpoint, timeout_s)
    resolve_model(local.model.name, revision=local.model.revision)
    wait_for_endpoint(rendezvous)
    return local.learner.nproc, rendezvous, write_rank_file(local.model_dump(mode="json"))


def main() -> None:
    """``torchrun`` (``torch.distributed.run``); a SIGTERM or SIGINT it got ends it with 128 + the signal's number,
    as a shell reports a process the signal ended, not with a traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except SignalException as exc:
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    main()
