"""A hostile coder for the chaos suite: the real actor loop whose policy writes the hostile programs.

The ``hostile-code`` scenario's attacker: an actor holding a launched actor's kind of credentials (the harness plays
the fleet, as for the liars) whose engine answers every prompt with the next program of the hostile suite
(``hostile_programs.py``: fork bomb, spin, 10 GB, writes and reads outside, a loopback connection, 1 GB of output,
setsid, killing its parent), in a fenced block as a policy would reply. Everything else is the real actor: the
code task scores each reply by running it in the task's own sandbox (``CodeTask.rewards``), the file is committed,
and the learner runs them again (``learner/verify.py``). Its rewards are the task's and its behavior
log-probabilities are the policy's own for the tokens it sends (one teacher-forced pass of the version it holds),
so it is a policy that wrote hostile code, not a liar: the learner must take its files like any others.

What the sandbox returned for each program on this actor is appended to ``--report`` (JSON lines): the program's
name, the sandbox's status and seconds, and what the program reported getting (``WROTE`` paths, ``READ``,
``REACHED``, ``ALLOCATED``) or whether one of ``--secrets`` appeared in its output; never the output itself.

    python -m echo2.chaos.hostile_actor --run STORE/runs/ID --actor-id ID --targets TARGETS.json --report OUT.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import threading
from pathlib import Path
from typing import Iterable

import torch

from echo2.chaos.hostile_programs import NAMES, hostile_programs
from echo2.rollout import actor as actor_module
from echo2.rollout.engines.base import Completion, Engine, SamplingParams
from echo2.tasks import sandbox as sandbox_module

TAG = "# hostile-code: "
"""The first line of each reply's program: which hostile program it is (read back from the sandbox's source)."""


def replies(programs: dict[str, str]) -> list[str]:
    """The hostile suite as a policy would reply, one fenced block each, in ``NAMES`` order."""
    return [f"```python\n{TAG}{name}\n{programs[name].rstrip()}\n```" for name in NAMES]


class HostileEngine(Engine):
    """The actor's transformers engine, whose every completion is the next hostile reply instead of a sample;
    the log-probabilities are the held version's own for those tokens (tempered like a sample's)."""

    def __init__(self, model_dir: Path, tokenizer, texts: list[str]):
        from echo2.rollout.engines.transformers import TransformersEngine

        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.inner = TransformersEngine(model_dir, eos_token_id=eos, pad_token_id=pad, dtype="float32", device="cpu")
        self.eos = eos
        self.tokens = [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
        self._next = itertools.cycle(range(len(texts)))

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.inner.load_weights(tensors)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        out = []
        for prompt in prompts:
            group = []
            for _ in range(params.n):
                tokens = self.tokens[next(self._next)]
                if len(tokens) > params.max_new_tokens:
                    raise ValueError(f"a hostile reply is {len(tokens)} tokens, over rollout.max_new_tokens "
                                     f"{params.max_new_tokens}: the scenario sizes that limit")
                group.append(Completion(tokens, self._logprobs(prompt, tokens, params.temperature), "stop"))
            out.append(group)
        return out

    def _logprobs(self, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
        ids = torch.tensor([list(prompt) + tokens], dtype=torch.long)
        logits = self.inner.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return logp.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()


def record_outcomes(report: Path, secrets: list[str]) -> None:
    """Wrap ``Sandbox.run`` in this process: each hostile program's outcome, as the module docstring says."""
    honest_run = sandbox_module.Sandbox.run
    lock = threading.Lock()

    def run(self, source, handshake=None):
        outcome = honest_run(self, source, handshake)
        # the program travels inside the harness as a string literal: its tag is found as text, not as a line
        name = next((n for n in NAMES if f"{TAG}{n}" in source), None)
        if name is not None:
            text = outcome.stdout + outcome.stderr
            lines = outcome.stdout.splitlines()
            entry = {"name": name, "status": outcome.status, "seconds": round(outcome.seconds, 3),
                     "wrote": [line.split(" ", 1)[1] for line in lines if line.startswith("WROTE ")],
                     "read": sum(line.startswith("READ ") for line in lines),
                     "reached": "REACHED" in outcome.stdout, "allocated": "ALLOCATED" in outcome.stdout,
                     "secret_seen": any(s and s in text for s in secrets), "stdout_bytes": len(outcome.stdout)}
            with lock, open(report, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return outcome

    sandbox_module.Sandbox.run = run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--actor-id", required=True)
    parser.add_argument("--targets", required=True, help="JSON: mark, outside, key_file, port, secrets")
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    targets = json.loads(Path(args.targets).read_text())
    programs = hostile_programs(mark=targets["mark"], outside=targets["outside"], key_file=targets["key_file"],
                                port=targets["port"])
    record_outcomes(Path(args.report), targets["secrets"])
    texts = replies(programs)
    actor_module.run_actor(args.run, args.actor_id, json.loads(os.environ.get("ECHO2_STORE_OPTIONS") or "{}"),
                           engine_factory=lambda model_dir, tokenizer: HostileEngine(model_dir, tokenizer, texts))


if __name__ == "__main__":
    main()
