"""Token-budget packing (echo2/learner/packing.py): first-fit decreasing, padding-free rows whose
attention never crosses a sequence boundary."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from echo2.learner.packing import Ragged, StepColumns, assemble_packed, pack_by_tokens


def random_columns(lengths: list[tuple[int, int]], *, seed: int = 0, vocab: int = 300, group_size: int = 2,
                   env_tokens: bool = True) -> StepColumns:
    """Rows of (prompt, completion) lengths; every third completion token an environment token (mask 0)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(p)] for p, _ in lengths]
    comps = [[rng.randrange(3, vocab) for _ in range(c)] for _, c in lengths]
    masks = [[0 if env_tokens and k % 3 == 2 else 1 for k in range(len(c))] for c in comps]
    behavior = [[-rng.uniform(0.1, 4.0) for _ in c] for c in comps]
    n = len(lengths)
    return StepColumns(
        prompt=Ragged.from_lists(prompts, torch.int32), completion=Ragged.from_lists(comps, torch.int32),
        completion_mask=Ragged.from_lists(masks, torch.int8).values,
        behavior_logprobs=Ragged.from_lists(behavior, torch.float32).values,
        reward=torch.tensor([float(rng.random() < 0.5) for _ in range(n)]),
        group_index=torch.arange(n) // group_size, policy_version=torch.zeros(n, dtype=torch.int64))


def test_first_fit_decreasing_packs_every_index_once_within_the_budget():
    rng = random.Random(1)
    for trial in range(200):
        budget = rng.randint(1, 64)
        lengths = [rng.randint(1, 80) for _ in range(rng.randint(0, 40))]
        packs = pack_by_tokens(lengths, budget)
        assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
        for p in packs:  # over the budget only as a lone overlong sequence
            assert sum(lengths[i] for i in p) <= budget or (len(p) == 1 and lengths[p[0]] > budget)
        # first fit: a pack's first (longest) item did not fit in any earlier pack when it was placed
        for j, p in enumerate(packs):
            first = lengths[p[0]]
            for earlier in packs[:j]:
                placed_before = [i for i in earlier if (-lengths[i], i) < (-first, p[0])]
                assert sum(lengths[i] for i in placed_before) + first > budget
        assert pack_by_tokens(lengths, budget) == packs  # deterministic
    assert pack_by_tokens([5, 5, 4, 3, 3], 10) == [[0, 1], [2, 3, 4]]
    assert pack_by_tokens([30, 2, 9], 10) == [[0], [2], [1]]
    with pytest.raises(ValueError, match="holds nothing"):
        pack_by_tokens([1], 0)


def test_an_assembled_pack_lays_sequences_end_to_end():
    cols = random_columns([(3, 2), (1, 4)])
    batch = assemble_packed(cols, [1, 0], torch.tensor([0.5, -2.0]))
    prompts = [cols.prompt.values[0:3].tolist(), cols.prompt.values[3:4].tolist()]
    comps = [cols.completion.values[0:2].tolist(), cols.completion.values[2:6].tolist()]
    full = [prompts[0] + comps[0], prompts[1] + comps[1]]
    assert batch.input_ids.tolist() == [full[1][:-1] + full[0][:-1]]
    assert batch.targets.tolist() == [full[1][1:] + full[0][1:]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    # row 1's targets are all completion tokens (mask 1, 1, 0, 1); row 0's two prompt targets train nothing
    assert batch.mask.tolist() == [[1, 1, 0, 1, 0, 0, 1, 1]]
    assert batch.advantages.tolist() == [[-2.0] * 4 + [0.5] * 4]
    behavior = cols.behavior_logprobs.tolist()
    assert batch.behavior_logprobs[0, :4].tolist() == behavior[2:6]
    assert batch.behavior_logprobs[0, 4:].tolist() == [0.0, 0.0] + behavior[0:2]
    assert batch.rows == [1, 0] and batch.tokens == 8 and batch.policy_tokens == 5


def logprobs_of(model, input_ids, targets, position_ids=None):
    """log p(targets[j] | input_ids[:j+1]) from the full logits (use_cache=False: a cache turns off packing)."""
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_row_computes_each_sequence_as_if_alone(tiny_model, attn):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=attn).eval()
    cols = random_columns([(5, 1), (9, 20), (3, 7), (12, 2), (1, 1)])
    batch = assemble_packed(cols, range(5), torch.zeros(5))
    with torch.no_grad():
        packed = logprobs_of(model, batch.input_ids, batch.targets, batch.position_ids)
        alone = torch.cat([logprobs_of(model, b.input_ids, b.targets)
                           for b in (assemble_packed(cols, [i], torch.zeros(5)) for i in range(5))], dim=1)
        crossing = logprobs_of(model, batch.input_ids, batch.targets)  # one long sequence: attention crosses
    assert torch.allclose(packed, alone, atol=1e-5), (packed - alone).abs().max()
    assert not torch.allclose(crossing, alone, atol=1e-2)  # the test can tell the two apart
