"""Builders for rollout files used by several tests."""

from echo2.data import layout
from echo2.data.rollouts import Rollout, encode_rollouts


def make_rollouts(n_groups=2, group_size=2, *, vocab=100, reward=lambda g, s: float(s == 0), logprob=-0.5):
    out = []
    for g in range(n_groups):
        for s in range(group_size):
            out.append(Rollout(prompt_id=f"p{g}", group_id=f"g{g}", sample_index=s, prompt_token_ids=[1, 2, 3],
                               completion_token_ids=[4, 5, min(6, vocab - 1)], behavior_logprobs=[logprob] * 3,
                               reward=reward(g, s), finish_reason="stop", reward_detail={"ok": True}))
    return out


def rollout_bytes(version, *, run_id="run", rollouts=None, **kw):
    return encode_rollouts(rollouts if rollouts is not None else make_rollouts(**kw), run_id=run_id,
                           actor_id="a", policy_version=version, task="arithmetic")


def commit_rollouts(store, version, seq, *, actor="a", run_id="run", data=None, **kw):
    key = layout.rollout_key(version, actor, seq)
    store.put(key, data if data is not None else rollout_bytes(version, run_id=run_id, **kw))
    return key
