"""Shared by the tests: moved out of test_prices.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

START = 1_700_000_000.0


def _synthetic_run(root, files: list[tuple[str, int, int, float]], events: list[dict]):
    """A run folder: rollout files (actor, version, completion tokens per row x 4 rows, seconds), each used by
    a step whose ledger entry records its figures as the learner does, and committed (by the store's clock, the
    files' modification times) 10 s after the one before, from ``START``; and events, at ``START`` unless they say."""
    import os

    from echo2.data import layout
    from echo2.data.ledger import used_measurements, write_consumed, write_event
    from echo2.data.rollouts import Rollout, decode_rollouts, encode_rollouts
    from echo2.data.store import open_store

    store = open_store(str(root))
    store.put_json(layout.RUN_JSON, {"config": {}})
    for seq, (actor, version, tokens, seconds) in enumerate(files):
        rows = [Rollout(prompt_id="p", group_id=f"{actor}-{seq}", sample_index=i, prompt_token_ids=[1, 2],
                        completion_token_ids=[3] * tokens, behavior_logprobs=[-0.5] * tokens, reward=1.0,
                        finish_reason="stop", generation_seconds=seconds) for i in range(4)]
        data = encode_rollouts(rows, run_id="r", actor_id=actor, policy_version=version, task="arithmetic")
        key = layout.rollout_key(version, actor, seq)
        store.put(key, data)
        os.utime(root / key, (START + 10 * (seq + 1),) * 2)
        write_consumed(store, seq + 1, {"used": [{"key": key, "policy_version": version,
                                                  "measured": used_measurements(decode_rollouts(data))}]})
    for e in events:
        write_event(store, e.pop("kind"), e.pop("actor_id"), **{"ts": START, **e})
    return store
