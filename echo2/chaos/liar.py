"""A dishonest actor for the chaos suite: the real actor loop, which lies in what it commits.

It plays an attacker holding one actor's credentials (a token the learner signed, store access): it
generates with the real engine, then before each commit it either claims behavior logprobs its policy
did not give (``logprobs``: every token said to be likelier than it was, which shrinks the ratio the
loss divides by) or rewards its completions did not earn (``rewards``). The learner must ban it
(``learner/spot_check.py``, ``verify.py``), and the next version must revoke its token.

    python -m echo2.chaos.liar --run STORE/runs/ID --actor-id ID --lie logprobs|rewards
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from echo2.data.rollouts import Rollout
from echo2.rollout import actor as actor_module


def lies(kind: str, rollouts: list[Rollout]) -> list[Rollout]:
    """What the liar commits instead of what it generated."""
    if kind == "logprobs":
        return [dataclasses.replace(r, behavior_logprobs=[max(x + 1.5, -0.01) if x < 0 else x
                                                          for x in r.behavior_logprobs]) for r in rollouts]
    return [dataclasses.replace(r, reward=1.0) for r in rollouts]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--actor-id", required=True)
    parser.add_argument("--lie", choices=["logprobs", "rewards"], default="logprobs")
    args = parser.parse_args()
    honest_encode = actor_module.encode_rollouts
    # the attacker's own copy of the actor: the real loop, with its commit rewritten (nothing in echo2 helps)
    actor_module.encode_rollouts = lambda rollouts, **kw: honest_encode(lies(args.lie, rollouts), **kw)
    actor_module.run_actor(args.run, args.actor_id, json.loads(os.environ.get("ECHO2_STORE_OPTIONS") or "{}"))


if __name__ == "__main__":
    main()
