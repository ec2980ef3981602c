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


def test_packs_are_dealt_to_ranks_by_tokens():
    from echo2.learner.distributed import deal_by_tokens

    rng = random.Random(2)
    for _ in range(100):
        tokens = [rng.randint(1, 500) for _ in range(rng.randint(1, 30))]
        ranks = rng.randint(1, 4)
        dealt = deal_by_tokens(tokens, ranks)
        assert len(dealt) == ranks and sorted(j for d in dealt for j in d) == list(range(len(tokens)))
        loads = [sum(tokens[j] for j in d) for d in dealt]
        assert max(loads) - min(loads) <= max(tokens)  # longest-first greedy: within one pack of even
    assert deal_by_tokens([100, 10, 10, 10, 10], 2) == [[0], [1, 2, 3, 4]]  # one rank runs 3 fillers


def test_a_small_step_gives_every_rank_a_pack():
    """With one pack of micro_batch_tokens, ranks 1..N-1 would run only zero-weight fillers."""
    from types import SimpleNamespace

    from echo2.config import TrainConfig
    from echo2.learner.distributed import DistributedLearner, deal_by_tokens

    four_ranks = SimpleNamespace(config=TrainConfig(micro_batch_tokens=8192), world_size=4)
    lengths = [30 + i % 7 for i in range(16)]
    packs = pack_by_tokens(lengths, DistributedLearner._pack_budget(four_ranks, sum(lengths)))
    dealt = deal_by_tokens([sum(lengths[i] for i in p) for p in packs], 4)
    assert all(dealt) and len(packs) <= 8
    assert DistributedLearner._pack_budget(four_ranks, 10**6) == 8192


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


def logprobs_of(model, input_ids, targets, position_ids=None, **attention):
    """log p(targets[j] | input_ids[:j+1]) from the full logits (use_cache=False: a cache turns off packing);
    ``attention``: keyword arguments for the attention calls (a pack's boundaries)."""
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention).logits
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("attn", ["sdpa", "eager", "varlen"])
def test_a_packed_row_computes_each_sequence_as_if_alone(tiny_model, attn):
    """varlen: the learner's attention for packs (learner/attention.py), given the pack's layout, no mask."""
    from echo2.learner.attention import pack_attention, register

    implementation = register() if attn == "varlen" else attn
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                 attn_implementation=implementation).eval()
    cols = random_columns([(5, 1), (9, 20), (3, 7), (12, 2), (1, 1)])
    batch = assemble_packed(cols, range(5), torch.zeros(5))
    bounds = pack_attention(batch.layout, batch.input_ids.device) if attn == "varlen" else {}
    with torch.no_grad():
        packed = logprobs_of(model, batch.input_ids, batch.targets, batch.position_ids, **bounds)
        alone = torch.cat([logprobs_of(model, b.input_ids, b.targets)
                           for b in (assemble_packed(cols, [i], torch.zeros(5)) for i in range(5))], dim=1)
        crossing = logprobs_of(model, batch.input_ids, batch.targets)  # one long sequence: attention crosses
    assert torch.allclose(packed, alone, atol=1e-5), (packed - alone).abs().max()
    assert not torch.allclose(crossing, alone, atol=1e-2)  # the test can tell the two apart


@pytest.mark.parametrize("attn", ["sdpa", "varlen"])
def test_nothing_leaks_across_the_sequences_of_a_pack(tiny_model, attn):
    """Changing every token of one sequence changes no other sequence's log-probability, not by one ulp."""
    from echo2.learner.attention import pack_attention, register

    implementation = register() if attn == "varlen" else attn
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                 attn_implementation=implementation).eval()
    cols = random_columns([(6, 9), (8, 5), (4, 12)])
    batch = assemble_packed(cols, range(3), torch.zeros(3))
    bounds = pack_attention(batch.layout, batch.input_ids.device) if attn == "varlen" else {}
    first = int(batch.sequence_lengths[0])
    changed = batch.input_ids.clone()
    changed[0, :first] = (changed[0, :first] + 17) % 300
    with torch.no_grad():
        before = logprobs_of(model, batch.input_ids, batch.targets, batch.position_ids, **bounds)
        after = logprobs_of(model, changed, batch.targets, batch.position_ids, **bounds)
    assert not torch.equal(before[0, :first], after[0, :first])  # the change reached its own sequence
    if attn == "varlen":  # each sequence is computed on its own: bit for bit the same
        assert torch.equal(before[0, first:], after[0, first:])
    else:  # one masked product over the pack: the same up to the summation order of masked-out zeros
        assert torch.allclose(before[0, first:], after[0, first:], atol=1e-6)


def shared_prompt_columns() -> StepColumns:
    """Rows 0-2: one group sharing a 9-token prompt (completions of 1, 6 and 11 tokens); row 3 another group's; rows
    4-5 a group of two with a one-token prompt."""
    cols = random_columns([(9, 1), (9, 6), (9, 11), (5, 4), (1, 3), (1, 7)], seed=3)
    values, offsets = cols.prompt.values.clone(), cols.prompt.offsets
    for r in (1, 2):  # the group's rows carry the same prompt
        values[offsets[r] : offsets[r + 1]] = values[offsets[0] : offsets[1]]
    values[offsets[5] : offsets[6]] = values[offsets[4] : offsets[5]]
    cols.prompt = Ragged(offsets, values)
    cols.group_index = torch.tensor([0, 0, 0, 1, 2, 2])
    return cols


def test_rows_that_share_a_prompt_lay_it_down_once_and_compute_each_row_as_if_alone(tiny_model):
    """A group's prompt is one prefix in the pack (9 - 1 tokens once, not three times), and every row's
    log-probabilities equal its own sequence's computed alone."""
    from echo2.learner.attention import pack_attention, register
    from echo2.learner.packing import pack_rows, pack_tokens

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                 attn_implementation=register()).eval()
    cols = shared_prompt_columns()
    batch = assemble_packed(cols, range(6), torch.zeros(6), share_prompts=True)
    assert batch.layout == [(8, [1, 6, 11]), (4, [4]), (0, [3, 7])]
    assert batch.tokens == pack_tokens(cols, range(6), share_prompts=True) == 8 + 18 + 8 + 10
    assert pack_tokens(cols, range(6), share_prompts=False) == sum(p + c - 1 for p, c in
                                                                   [(9, 1), (9, 6), (9, 11), (5, 4), (1, 3), (1, 7)])
    with torch.no_grad():
        packed = logprobs_of(model, batch.input_ids, batch.targets, batch.position_ids,
                             **pack_attention(batch.layout, batch.input_ids.device))
        alone = [(b, logprobs_of(model, b.input_ids, b.targets, b.position_ids))
                 for b in (assemble_packed(cols, [r], torch.zeros(6)) for r in range(6))]
    weighed = torch.cat([lp[b.mask > 0] for b, lp in alone])
    assert torch.equal(batch.targets[batch.mask > 0], torch.cat([b.targets[b.mask > 0] for b, _ in alone]))
    assert torch.allclose(packed[batch.mask > 0], weighed, atol=1e-5), (packed[batch.mask > 0] - weighed).abs().max()
    # and a group too big for one pack is cut into pieces that each fit, each with its prefix
    packs = pack_rows(cols, range(6), lambda _: 20, share_prompts=True)
    assert sorted(r for pack in packs for r in pack) == list(range(6))
    assert all(pack_tokens(cols, pack, share_prompts=True) <= 20 or len(pack) == 1 for pack in packs)


def test_nothing_leaks_between_the_rows_of_a_shared_prompt(tiny_model):
    """Changing one row's completion changes no other row's log-probabilities and not its prompt's, bit for bit."""
    from echo2.learner.attention import pack_attention, register

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                 attn_implementation=register()).eval()
    cols = shared_prompt_columns()
    batch = assemble_packed(cols, range(3), torch.zeros(6), share_prompts=True)
    bounds = pack_attention(batch.layout, batch.input_ids.device)
    start = 8 + 1  # the second row's segment: its prompt's last token, then its completion
    changed = batch.input_ids.clone()
    changed[0, start + 1 : start + 6] = (changed[0, start + 1 : start + 6] + 17) % 300
    with torch.no_grad():
        before = logprobs_of(model, batch.input_ids, batch.targets, batch.position_ids, **bounds)
        after = logprobs_of(model, changed, batch.targets, batch.position_ids, **bounds)
    assert not torch.equal(before[0, start + 1 : start + 6], after[0, start + 1 : start + 6])
    assert torch.equal(before[0, : start + 1], after[0, : start + 1])  # the prefix and the first row
    assert torch.equal(before[0, start + 6 :], after[0, start + 6 :])  # the third row


# -- the learner's step against the padded full-logits step it replaces --------------------------------

def padded_assemble(rows: list[dict], pad_token_id: int):
    """The learner's batch before packing (echo2/learner/batch.py until issue 19): rows right-padded to the
    longest; position j predicts token j + 1; targets, mask and behavior logprobs (B, W - 1)."""
    lengths = [len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows]
    width = max(lengths)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.zeros((len(rows), width - 1), dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1))
    behavior = torch.zeros((len(rows), width - 1))
    for i, r in enumerate(rows):
        p, c = r["prompt_token_ids"], r["completion_token_ids"]
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        span = slice(len(p) - 1, len(p) - 1 + len(c))
        targets[i, span] = torch.tensor(c)
        mask[i, span] = torch.tensor(r["completion_mask"], dtype=torch.float32)
        behavior[i, span] = torch.tensor(r["behavior_logprobs"], dtype=torch.float32)
    return ids, attn, targets, mask, behavior


def padded_full_logits_step(model_dir, tables, cfg, temperature: float, micro_batch_size: int, pad_token_id: int):
    """One GRPO step as the learner took it before issue 19: Python rows (``rows_of``), micro-batches of
    ``micro_batch_size`` rows sorted by length, right padding, the full logits and their log-softmax."""
    from echo2.learner.loss import group_advantages, policy_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    rows = []
    for file_index, table in enumerate(tables):
        for row in table.to_pylist():
            rows.append({**row, "group": (file_index, row["group_id"])})
    group_ids = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in rows))}
    rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
    group_index = torch.tensor([group_ids[r["group"]] for r in rows])
    advantages = group_advantages(rewards, group_index, scale=cfg.scale_rewards)
    signal = {g for g in group_ids.values()
              if len({r for r, i in zip(rewards.tolist(), group_index.tolist()) if i == g}) > 1}
    keep = sorted((i for i in range(len(rows)) if int(group_index[i]) in signal),
                  key=lambda i: len(rows[i]["prompt_token_ids"]) + len(rows[i]["completion_token_ids"]))
    n_tokens = sum(sum(rows[i]["completion_mask"]) for i in keep)
    loss_total = 0.0
    for start in range(0, len(keep), micro_batch_size):
        idx = keep[start : start + micro_batch_size]
        ids, attn, targets, mask, behavior = padded_assemble([rows[i] for i in idx], pad_token_id)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        terms = policy_loss(logprobs, behavior, advantages[idx], mask, n_tokens=n_tokens, clip_low=cfg.clip_low,
                            clip_high=cfg.clip_high, is_cap=cfg.is_cap)
        terms.loss.backward()
        loss_total += terms.loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm).item()
    optimizer.step()
    return {"loss": loss_total, "grad_norm": grad_norm, "train_tokens": n_tokens}, model


def uneven_tables(seed: int = 0, files: int = 2, versions: tuple[int, ...] = (0, 0, 0, 0)):
    """Files of groups of 4 whose completions run from 1 to 200 tokens (every 5th an environment token),
    rewards mixed except in one group per file (no signal: left out of the step)."""
    from echo2.data.rollouts import Rollout, decode_rollouts, encode_rollouts

    rng = random.Random(seed)
    tables = []
    for f in range(files):
        rows = []
        for g in range(3):
            prompt = [rng.randrange(3, 300) for _ in range(rng.randint(2, 30))]
            for s in range(4):
                n = rng.choice([1, 2, 7, 40, 120, 200]) if s else 200 - 10 * g
                rows.append(Rollout(
                    prompt_id=f"p{f}{g}", group_id=f"g{g}", sample_index=s, prompt_token_ids=prompt,
                    completion_token_ids=[rng.randrange(3, 300) for _ in range(n)],
                    completion_mask=[0 if k % 5 == 4 else 1 for k in range(n)],
                    behavior_logprobs=[-rng.uniform(4.5, 7.0) for _ in range(n)],
                    reward=1.0 if g == 2 else float(rng.random() < 0.5 or s == 0), finish_reason="stop"))
            if g < 2:
                rows[-1].reward = 0.0  # a group with signal
        data = encode_rollouts(rows, run_id="run", actor_id="a", policy_version=versions[f], task="arithmetic")
        tables.append(decode_rollouts(data))
    return tables


def saved_for_backward(learner) -> int:
    """How many tensors autograd keeps from one forward of the learner's policy."""
    count = 0

    def keep(t):
        nonlocal count
        count += 1
        return t

    ids = torch.arange(3, 43)[None]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        learner.policy(ids, ids, position_ids=torch.arange(40)[None])
    return count


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


@pytest.mark.parametrize("attention,weight_bound", [("sdpa", 1e-5), ("varlen", 2e-5)])
def test_a_packed_chunked_checkpointed_step_equals_the_padded_full_logits_step(tiny_model, attention, weight_bound):
    """The learner with every new option on (small token budget: 11 packs of rows of 7 to 228 tokens; small
    logprob chunks; activation checkpointing; with varlen, each group's shared prompt laid down once) against the
    padded full-logits step, in fp32: loss and gradient norm within 1e-5 relative, every weight tensor after one
    AdamW step within ``weight_bound`` relative (||ours - theirs|| / ||theirs||) and every element within 1% of the
    learning rate. AdamW's first step moves an element by lr g / (|g| + eps), so where a gradient is near eps (1e-8)
    float-order noise is amplified (measured: one element of 1,024 off by 2.7e-6, 0.3% of its 1e-3 update); varlen
    adds up attention piece by piece, in another order than one masked product."""
    from echo2.config import TrainConfig
    from echo2.learner.learner import Learner

    tables = uneven_tables()
    cfg = TrainConfig(lr=1e-3, micro_batch_tokens=300, logprob_chunk_tokens=37, activation_checkpointing=True,
                      attention=attention)
    learner = Learner(tiny_model, cfg, temperature=0.9)
    plain = Learner(tiny_model, TrainConfig(), temperature=0.9)
    assert saved_for_backward(learner) < saved_for_backward(plain) / 2  # activation checkpointing is on
    metrics = learner.train_step(tables)
    reference, model = padded_full_logits_step(tiny_model, tables, cfg, 0.9, micro_batch_size=4,
                                               pad_token_id=learner.tokenizer.pad_token_id)
    assert metrics["train_tokens"] == reference["train_tokens"] > 0 and metrics["groups_with_signal"] == 4
    assert relative(metrics["loss"], reference["loss"]) < 1e-5, (metrics["loss"], reference["loss"])
    assert relative(metrics["grad_norm"], reference["grad_norm"]) < 1e-5, (metrics["grad_norm"], reference["grad_norm"])
    ours, theirs = learner.full_tensors(), model.state_dict()
    worst = max(((ours[k] - theirs[k]).norm() / theirs[k].norm()).item() for k in ours)
    print(f"packed vs padded step: loss {metrics['loss']:.6g} vs {reference['loss']:.6g}, "
          f"grad norm {metrics['grad_norm']:.6g} vs {reference['grad_norm']:.6g}, worst weight {worst:.2e}")
    assert worst < weight_bound
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 0.01 * cfg.lr


# -- Arrow columns -------------------------------------------------------------------------------------

def python_reading(tables) -> dict:
    """What the learner read before issue 19 (``rows_of``): Python lists, groups by (file, group_id)."""
    rows = [{**row, "group": (f, row["group_id"])} for f, t in enumerate(tables) for row in t.to_pylist()]
    group_ids = {g: i for i, g in enumerate(dict.fromkeys(r["group"] for r in rows))}
    return {"prompt": [r["prompt_token_ids"] for r in rows], "completion": [r["completion_token_ids"] for r in rows],
            "mask": [x for r in rows for x in r["completion_mask"]],
            "behavior": [x for r in rows for x in r["behavior_logprobs"]], "reward": [r["reward"] for r in rows],
            "group": [group_ids[r["group"]] for r in rows], "version": [r["policy_version"] for r in rows]}


def columns_reading(columns) -> dict:
    def lists(ragged):
        o = ragged.offsets.tolist()
        return [ragged.values[o[i] : o[i + 1]].tolist() for i in range(len(o) - 1)]

    return {"prompt": lists(columns.prompt), "completion": lists(columns.completion),
            "mask": columns.completion_mask.tolist(), "behavior": columns.behavior_logprobs.tolist(),
            "reward": columns.reward.tolist(), "group": columns.group_index.tolist(),
            "version": columns.policy_version.tolist()}


def test_columns_of_sliced_and_multi_chunk_tables_equal_the_python_reading():
    import pyarrow as pa

    from echo2.learner.columns import step_columns

    a, b = uneven_tables(seed=3)
    rebatched = pa.Table.from_batches(a.to_batches(max_chunksize=5))  # chunks whose offsets do not start at 0
    assert rebatched.column("prompt_token_ids").num_chunks == 3
    cases = [[a], [a, b], [a.slice(3, 6)], [rebatched, b.slice(1)], [pa.concat_tables([a.slice(2, 4), a.slice(7)]), b]]
    for tables in cases:
        columns = step_columns(tables)
        assert columns_reading(columns) == python_reading(tables)
        assert columns.prompt.offsets[0] == 0 and columns.prompt.values.dtype == torch.int32
    # two files' "g0" stay two groups; a file's groups are numbered by first appearance
    assert step_columns([a, a]).group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4


def test_a_steps_metrics_are_those_of_the_python_reading(tiny_model):
    """rollouts, groups, rewards, lags and token counts as rows_of and step_on_rows computed them."""
    from echo2.config import TrainConfig
    from echo2.learner.learner import Learner

    tables = uneven_tables(seed=5, files=3, versions=(0, 2, 1))
    py = python_reading(tables)
    learner = Learner(tiny_model, TrainConfig(lr=1e-3, micro_batch_tokens=256), temperature=1.0)
    learner.version = 3
    metrics = learner.train_step(tables)
    lags = [3 - v for v in py["version"]]
    by_group = {}
    for g, r in zip(py["group"], py["reward"]):
        by_group.setdefault(g, set()).add(r)
    signal = {g for g, rewards in by_group.items() if len(rewards) > 1}
    masks, start = [], 0
    for c in py["completion"]:
        masks.append(py["mask"][start : start + len(c)])
        start += len(c)
    assert metrics["step"] == 4 and metrics["rollouts"] == len(py["reward"]) == 36
    assert metrics["groups"] == len(by_group) == 9 and metrics["groups_with_signal"] == len(signal) == 6
    assert metrics["lag_mean"] == pytest.approx(sum(lags) / len(lags)) and metrics["lag_max"] == max(lags) == 3
    assert metrics["reward"] == pytest.approx(sum(py["reward"]) / len(py["reward"]))
    assert metrics["completion_tokens"] == sum(len(c) for c in py["completion"])
    assert metrics["train_tokens"] == sum(sum(m) for m, g in zip(masks, py["group"]) if g in signal)


def test_an_old_config_naming_micro_batch_size_is_refused_in_one_line(tmp_path):
    from echo2.config import ConfigError, load_config

    path = tmp_path / "old.yaml"
    path.write_text("train:\n  micro_batch_size: 16\n")
    with pytest.raises(ConfigError, match="micro_batch_size .* was replaced by train.micro_batch_tokens") as err:
        load_config(path)
    assert "\n" not in str(err.value)
    assert load_config(None).train.micro_batch_tokens == 8192
