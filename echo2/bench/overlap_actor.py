"""A rollout actor of the overlap benchmark: the real ``Actor`` loop on the timing workload.

    python -m echo2.bench.overlap_actor --batch-seconds G [--read-mbps B] --run URL --actor-id ID --parent-pid PID

The fleet (``make_fleet``) starts it through its ``actor_command`` seam and appends ``--run``, ``--actor-id``
and ``--parent-pid``. Everything but the compute is the real actor: it follows LATEST and
receives each version in store mode (signed manifest, chunks checked against their sha256),
keeps its own flow control (``Actor._has_capacity``), and commits real rollout files that the
learner validates and re-scores. Two substitutions, both the *timing workload*:

- ``TimingEngine``: ``generate`` sleeps ``batch_seconds`` (G of the capacity model) and returns
  valid random completions instead of sampling a model;
- ``ThrottledStore``: reads of a version's files under ``policy/`` pass through a link of
  ``read_mbps`` MB/s per actor, so the dissemination time D of a version is about its size over
  that rate.

Never used by ``echo2 run``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Iterable

import torch

from echo2.data import layout
from echo2.data.store import ObjectStore
from echo2.rollout.engines import Completion, Engine, SamplingParams

_QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


class TimingEngine(Engine):
    """Generation replaced by a sleep of ``batch_seconds`` per batch (the timing workload).

    Completions are valid for the learner's checks: token ids inside the vocabulary, logprobs in
    [-5, -0.01], a finish reason that matches whether the end-of-sequence token closes them. Every
    other completion spells the right sum, so groups carry a reward signal and the learner's real
    (tiny) step runs a forward and backward pass on them instead of skipping them.
    """

    def __init__(self, tokenizer, batch_seconds: float, seed: int = 0):
        self.tokenizer = tokenizer
        self.batch_seconds = batch_seconds
        self.rng = random.Random(seed)
        self.vocab = len(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.weights_loaded = 0

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # whatever arrived (the tiny model and the ballast) was verified by the receiver; nothing to load
        self.weights_loaded += sum(1 for _ in tensors)

    def _answer(self, prompt: list[int]) -> list[int] | None:
        m = _QUESTION.search(self.tokenizer.decode(prompt, skip_special_tokens=True))
        return self.tokenizer.encode(str(int(m.group(1)) + int(m.group(2))), add_special_tokens=False) if m else None

    def _completion(self, answer: list[int] | None, params: SamplingParams) -> Completion:
        if answer is not None and self.rng.random() < 0.5 and len(answer) < params.max_new_tokens:
            tokens, reason = [*answer, self.eos], "stop"
        else:
            tokens, reason = [self.rng.randrange(self.vocab) for _ in range(params.max_new_tokens)], "length"
            if self.eos in tokens:  # a random end-of-sequence ends the completion there, as sampling would
                tokens, reason = tokens[: tokens.index(self.eos) + 1], "stop"
        return Completion(tokens, [-self.rng.uniform(0.01, 5.0) for _ in tokens], reason)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        started = time.time()
        out = [[self._completion(self._answer(p), params) for _ in range(params.n)] for p in prompts]
        time.sleep(max(0.0, self.batch_seconds - (time.time() - started)))
        return out


class Link:
    """A link of ``mb_per_s`` shared by every reader of one process: each read reserves the next
    free interval of the link (size / rate) and returns when its bytes would have arrived, so
    concurrent chunk requests (``broadcast.window``) share the rate instead of multiplying it."""

    def __init__(self, mb_per_s: float):
        self.bytes_per_s = mb_per_s * 2**20
        self._lock = threading.Lock()
        self._free_at = 0.0

    def pass_bytes(self, n: int) -> None:
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + n / self.bytes_per_s
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))


class ThrottledStore(ObjectStore):
    """An object store whose reads of version files pass through a ``Link`` (everything else is direct)."""

    def __init__(self, inner: ObjectStore, link: Link | None):
        self.inner = inner
        self.link = link
        self.url = inner.url

    def _read(self, key: str, data: bytes) -> bytes:
        # only a version's files: LATEST and manifests are tiny requests that a real link answers
        # beside a transfer, and queueing them behind one would stall the actor's loop, which reads
        # LATEST between batches, instead of delaying the version
        if (self.link is not None and key.startswith(layout.POLICY) and key != layout.LATEST
                and not key.endswith("/" + layout.MANIFEST)):
            self.link.pass_bytes(len(data))
        return data

    def get(self, key: str) -> bytes:
        return self._read(key, self.inner.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._read(key, self.inner.get_range(key, start, end))

    def put(self, key: str, data: bytes, *, if_absent: bool = True) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def put_pointer(self, key: str, data: bytes) -> None:
        self.inner.put_pointer(key, data)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def child(self, prefix: str) -> "ThrottledStore":
        return ThrottledStore(self.inner.child(prefix), self.link)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m echo2.bench.overlap_actor", description=__doc__.split("\n")[0])
    parser.add_argument("--batch-seconds", type=float, required=True, help="G: seconds per batch of the timing engine")
    parser.add_argument("--read-mbps", type=float, default=0.0,
                        help="MB/s of this actor's reads under policy/ (0: unthrottled)")
    parser.add_argument("--run", required=True)
    parser.add_argument("--actor-id", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("echo2").setLevel(logging.INFO)
    from echo2.data.store import open_store
    from echo2.rollout.actor import run_actor

    options: dict[str, Any] = json.loads(os.environ.get("ECHO2_STORE_OPTIONS") or "{}")
    store = ThrottledStore(open_store(args.run, options), Link(args.read_mbps) if args.read_mbps > 0 else None)

    def engine_factory(model_dir: Path, tokenizer) -> Engine:
        return TimingEngine(tokenizer, args.batch_seconds, seed=zlib.crc32(args.actor_id.encode()))

    run_actor(args.run, args.actor_id, options, parent_pid=args.parent_pid, store=store, engine_factory=engine_factory)
    # the actor has closed its receiver and removed its folder; what is left is the interpreter's
    # teardown with torch loaded (1.5-2.5 s here), which the fleet's stop would wait for at every point
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
