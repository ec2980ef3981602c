"""The learner's spot checks of behavior logprobs (echo2/learner/spot_check.py): honest actors pass (fp32 and
a bf16 engine), a lying one is caught and banned, and the fleet expels and replaces it."""

from __future__ import annotations

import dataclasses
import random

import pyarrow as pa
import pytest
import torch
from helpers import commit_rollouts, rollout_bytes
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from echo2.config import TrainConfig, load_config
from echo2.data.rollouts import Rollout, RolloutLimits, decode_rollouts
from echo2.data.store import open_store
from echo2.learner.collector import RolloutCollector
from echo2.learner.columns import step_columns
from echo2.learner.learner import Learner
from echo2.learner.spot_check import Dishonest, SpotChecker
from echo2.rollout.engines import SamplingParams
from echo2.rollout.engines.transformers import TransformersEngine
from echo2.tasks import make_task, prompt_token_ids

THRESHOLD = 0.15  # trust.spot_check_max_gap's default


@pytest.fixture(scope="module")
def setup(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = TransformersEngine(tiny_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    weights = load_file(tiny_model / "model.safetensors")
    engine.load_weights(weights.items())
    task = make_task(load_config(None).task)
    return tiny_model, tok, engine, weights, task


def honest_rows(setup, seed=0, groups=3, n=4, engine=None) -> list[Rollout]:
    """Rows sampled by ``engine`` (default: one with the model's own weights), with its logprobs."""
    _, tok, base_engine, _, task = setup
    engine = engine or base_engine
    problems = task.sample_train(random.Random(seed), groups)
    prompts = [prompt_token_ids(tok, p) for p in problems]
    torch.manual_seed(seed)
    out = []
    for gi, (problem, prompt, comps) in enumerate(zip(problems, prompts, engine.generate(
            prompts, SamplingParams(n=n, max_new_tokens=8)))):
        for si, c in enumerate(comps):
            reward = task.reward(problem, tok.decode(c.token_ids, skip_special_tokens=True))[0]
            out.append(Rollout(prompt_id=problem.id, group_id=f"g{gi}", sample_index=si, prompt_token_ids=prompt,
                               completion_token_ids=c.token_ids, behavior_logprobs=c.logprobs, reward=reward,
                               finish_reason=c.finish_reason))
    return out


def table_of(rows, actor="a") -> pa.Table:
    return decode_rollouts(rollout_bytes(1, rollouts=rows, actor=actor))


@pytest.fixture(scope="module")
def learner(setup):
    """The learner whose arithmetic the spot check uses (``Learner.behavior_gap``): small log-probability chunks."""
    return Learner(setup[0], TrainConfig(logprob_chunk_tokens=16), temperature=1.0)


def spot_checker(setup, learner, fraction=0.0) -> SpotChecker:
    weights = setup[3]
    a = SpotChecker(learner.behavior_gap, fraction=fraction, max_gap=THRESHOLD, keep_versions=3,
                        micro_batch_tokens=64)  # several packs and chunks per file
    a.published(1, weights)
    return a


def gap(a: SpotChecker, table: pa.Table, version: int = 1) -> float:
    total, count = a.gap_of(version, a.versions[version], step_columns([table]), a.micro_batch_tokens)
    return total / count


def bf16_engine_rows(setup, rows) -> list[Rollout]:
    """The same completions with the behavior logprobs a bf16 engine reports (weights and compute in bf16)."""
    model_dir = setup[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    out = []
    with torch.no_grad():
        for r in rows:  # full logits of one sequence, as an engine computes them
            ids = torch.tensor([r.prompt_token_ids + r.completion_token_ids])
            logits = model(input_ids=ids).logits[0, len(r.prompt_token_ids) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(r.prompt_token_ids):, None])[:, 0].tolist()
            out.append(dataclasses.replace(r, behavior_logprobs=lp))
    return out


def test_honest_actors_pass_and_a_lying_one_is_caught(setup, learner, capsys):
    a = spot_checker(setup, learner)
    rows = honest_rows(setup)
    fp32 = gap(a, table_of(rows))
    bf16 = gap(a, table_of(bf16_engine_rows(setup, rows)))
    # an actor that claims its tokens were likelier than they were (a smaller ratio pi/mu on the tokens it
    # wants pushed down, or a larger one where it wants them pushed up), or makes its numbers up
    inflated = [dataclasses.replace(r, behavior_logprobs=[min(0.0, x + 0.7) for x in r.behavior_logprobs])
                for r in rows]
    made_up = [dataclasses.replace(r, behavior_logprobs=[-0.05] * len(r.behavior_logprobs)) for r in rows]
    with capsys.disabled():
        print(f"\nspot check gaps (nats/token): honest fp32 {fp32:.2e}, honest bf16 engine {bf16:.2e}, "
              f"threshold {THRESHOLD}")
    assert fp32 < 1e-4 and bf16 < THRESHOLD / 3  # honest actors pass with a wide margin
    assert a.check_logprobs(table_of(rows), 1, "honest") is not None
    assert a.check_logprobs(table_of(bf16_engine_rows(setup, rows)), 1, "bf16") is not None
    for lie in (inflated, made_up):
        with pytest.raises(Dishonest, match="behavior logprobs are"):
            a.check_logprobs(table_of(lie), 1, "liar")
    assert a.check_logprobs(table_of(rows), 7, "someone") is None  # a version no longer held is not judged


def test_the_first_file_of_every_actor_is_checked_then_a_hidden_sample(setup, learner):
    a = spot_checker(setup, learner, fraction=0.0)
    assert a.wants("new") and a.wants("new")  # not checked yet: wanted until it is
    a.check_logprobs(table_of(honest_rows(setup)), 1, "new")
    assert not any(a.wants("new") for _ in range(50))  # fraction 0: only the first
    b = spot_checker(setup, learner, fraction=1.0)
    b.checked_actors.add("x")
    assert all(b.wants("x") for _ in range(20))


def test_a_lying_actor_is_banned_by_the_collector_and_its_later_files_are_quarantined(setup, learner, tmp_path):
    model_dir, tok, _, _, task = setup
    store = open_store(str(tmp_path))
    rows = honest_rows(setup, groups=2, n=2)
    liar = [dataclasses.replace(r, behavior_logprobs=[-0.01] * len(r.behavior_logprobs)) for r in rows]
    commit_rollouts(store, 1, 0, actor="a1-liar", data=rollout_bytes(1, rollouts=liar, actor="a1-liar"))
    honest = commit_rollouts(store, 1, 0, actor="a2-honest", data=rollout_bytes(1, rollouts=rows, actor="a2-honest"))
    limits = RolloutLimits(vocab_size=len(tok), group_size=2, max_completion_tokens=8, max_prompt_tokens=4096,
                           reward_range=(0.0, 1.0))
    col = RolloutCollector(store, run_id="run", staleness=2, groups_per_step=2, limits=limits,
                           spot_checker=spot_checker(setup, learner))
    sel = col.collect(step=2, learner_version=1, timeout_s=10)
    assert [u["key"] for u in sel.used] == [honest]
    assert "behavior logprobs are" in sel.quarantined[0]["reason"] and set(col.banned) == {"a1-liar"}
    col.settle(sel)
    later = commit_rollouts(store, 1, 1, actor="a1-liar", data=rollout_bytes(1, rollouts=rows, actor="a1-liar"))
    commit_rollouts(store, 1, 1, actor="a2-honest",
                    data=rollout_bytes(1, rollouts=honest_rows(setup, seed=1, groups=2, n=2), actor="a2-honest"))
    sel = col.collect(step=3, learner_version=1, timeout_s=10)
    # the ban record stands for its later files: neither used nor quarantined one by one; the janitor deletes them
    assert later not in {u["key"] for u in sel.used} | {q["key"] for q in sel.quarantined}
    col.janitor.drain()
    assert not store.exists(later)


def test_the_fleet_expels_a_banned_actor_once_and_replaces_it(tmp_path):
    from fleet_shared import FakeCloud, manager

    from echo2.data.ledger import read_events

    cloud = FakeCloud()
    fleet, store = manager(tmp_path, cloud, actors=2)
    fleet.start()
    liar = fleet.slots[0].actor_id
    for _ in range(3):  # the flow tells it at every reconcile; it acts once
        fleet.expel(liar, "behavior logprobs are 0.9 nats/token off")
    assert cloud.terminated == [liar] and liar in fleet.revoked and len(fleet.slots) == 2
    assert liar not in [s.actor_id for s in fleet.slots] and len(cloud.launched) == 3
    kinds = [e["kind"] for e in read_events(store)]
    assert kinds.count("expelled") == 1
    fleet.stop()


def learner_run(model_dir, tmp_path, monkeypatch, *, resume: bool, spot_check_fraction: float = 0.1, **train):
    """The learner of a run on a local store, with its key in a secrets folder of the test."""
    from echo2.config import config_from_dict
    from echo2.data import layout
    from echo2.learner.run import LearnerRun

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.delenv("ECHO2_RUN_KEY", raising=False)
    config = config_from_dict({
        "run": {"id": "r1"}, "store": {"url": str(tmp_path / "store")}, "model": {"name": str(model_dir)},
        "rollout": {"group_size": 4, "groups_per_batch": 3, "max_new_tokens": 8},
        "train": {"max_steps": 10, "groups_per_step": 3, **train}, "learner": {"num_threads": 1},
        "trust": {"spot_check_fraction": spot_check_fraction},
        "eval": {"before": False, "after": False}, "fleet": {"actors": 1},
    })
    return LearnerRun(config, open_store(str(tmp_path / "store")).child(layout.RUNS), resume=resume)


def test_a_resumed_lora_run_checks_against_the_weights_its_version_had(setup, tmp_path, monkeypatch):
    """A LoRA version publishes only its adapter; the spot checker must hold base + adapter
    merged (what actors run), after a resume as when the version was published."""
    model_dir, tok, _, _, _ = setup
    run = learner_run(model_dir, tmp_path, monkeypatch, resume=False, lora_rank=4, spot_check_fraction=1.0)
    for seed in range(2):  # two real steps of the adapter
        run.learner.train_step([decode_rollouts(rollout_bytes(0, salt=str(seed)))])
    with torch.no_grad():  # and an adapter that moves the policy far more than two tiny steps do
        for name, p in run.learner.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    run.publish()
    run.checkpoint()
    version = run.step
    merged = {k: v.clone() for k, v in run.learner.full_tensors().items()}
    run.sink.close()

    resumed = learner_run(model_dir, tmp_path, monkeypatch, resume=True, lora_rank=4, spot_check_fraction=1.0)
    assert resumed.step == version and resumed.spot_checker is not None
    engine = TransformersEngine(model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine.load_weights(merged.items())  # an honest actor: the base with the version's adapter merged
    honest = honest_rows(setup, engine=engine)
    # the tiny random model is close to uniform whatever its weights, so the base's numbers are only about
    # 0.1 nats/token off the adapter's: a spot checker that held the base (the bug) passed honest files with a
    # gap of that size instead of fp32 noise, and let through lies of that size
    gap = resumed.spot_checker.check_logprobs(table_of(honest), version, "honest")
    assert gap is not None and gap < 1e-4
    base = honest_rows(setup)  # sampled by the base model, claimed as the adapter's version
    assert resumed.spot_checker.check_logprobs(table_of(base), version, "stale") > 100 * gap
    inflated = [dataclasses.replace(r, behavior_logprobs=[min(0.0, x + 0.7) for x in r.behavior_logprobs])
                for r in honest]
    made_up = [dataclasses.replace(r, behavior_logprobs=[-0.05] * len(r.behavior_logprobs)) for r in honest]
    for lie in (inflated, made_up):
        with pytest.raises(Dishonest, match="behavior logprobs are"):
            resumed.spot_checker.check_logprobs(table_of(lie), version, "liar")
    resumed.sink.close()


def test_weights_the_model_does_not_have_are_refused_not_skipped(setup, learner):
    """An adapter's tensors given as a version: loading none of them would check against other weights."""
    a = spot_checker(setup, learner)
    a.published(2, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)})
    with pytest.raises(ValueError, match="not the model's"):
        a.check_logprobs(table_of(honest_rows(setup)), 2, "a")


def test_with_spot_checks_off_no_file_is_checked_and_a_lying_one_is_used(setup, tmp_path, monkeypatch):
    assert load_config(None).trust.spot_check_max_gap == THRESHOLD  # the documented default
    rows = honest_rows(setup)
    liar = [dataclasses.replace(r, behavior_logprobs=[-0.01] * len(r.behavior_logprobs)) for r in rows]
    results = {}
    for fraction in (0.0, 1.0):  # the same lying file, with spot checks off and on
        run = learner_run(setup[0], tmp_path / str(fraction), monkeypatch, resume=False, spot_check_fraction=fraction)
        key = commit_rollouts(run.store, 0, 0, actor="a1-liar",
                              data=rollout_bytes(0, rollouts=liar, actor="a1-liar", run_id=run.run_id))
        commit_rollouts(run.store, 0, 0, actor="a2-honest",  # fills the step where the lie is set aside
                        data=rollout_bytes(0, rollouts=rows, actor="a2-honest", run_id=run.run_id))
        sel = run.collector.collect(step=1, learner_version=0, timeout_s=30)
        results[fraction] = (run, key, sel)
        run.sink.close()
    run, key, sel = results[0.0]
    assert run.spot_checker is None and run.spot_check_summary()["files_checked"] == 0
    assert [u["key"] for u in sel.used] == [key] and not sel.quarantined and not run.collector.banned
    run, key, sel = results[1.0]  # the same file is caught where spot checks are on: the test can tell
    summary = run.spot_check_summary()
    assert summary["files_checked"] == 2 and set(run.collector.banned) == {"a1-liar"}  # each first file
    assert [q["key"] for q in sel.quarantined] == [key]


def test_a_resumed_run_checks_the_versions_before_its_checkpoint(setup, tmp_path, monkeypatch):
    """A resume restores version c only; files of c - 1 (within S) are still judged: the spot checker reads the version
    back from its signed folder. Before, it held c alone and passed every file of c - 1 unchecked (blind)."""
    model_dir, tok, _, _, _ = setup
    run = learner_run(model_dir, tmp_path, monkeypatch, resume=False, spot_check_fraction=1.0, lr=1e-2)
    weights = {}
    for seed in range(2):  # two real steps, each published
        run.learner.train_step([decode_rollouts(rollout_bytes(0, salt=str(seed)))])
        run.publish()
        weights[run.step] = run.learner.full_tensors()
    run.checkpoint()
    run.sink.close()
    resumed = learner_run(model_dir, tmp_path, monkeypatch, resume=True, spot_check_fraction=1.0, lr=1e-2)
    assert resumed.step == 2 and set(resumed.spot_checker.versions) == {2}
    engine = TransformersEngine(model_dir, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    engine.load_weights(weights[1].items())  # an honest actor still on version 1
    honest = honest_rows(setup, engine=engine)
    gap = resumed.spot_checker.check_logprobs(table_of(honest), 1, "honest")
    assert gap is not None and gap < 1e-4
    made_up = [dataclasses.replace(r, behavior_logprobs=[-0.05] * len(r.behavior_logprobs)) for r in honest]
    with pytest.raises(Dishonest, match="behavior logprobs are"):
        resumed.spot_checker.check_logprobs(table_of(made_up), 1, "liar")
    resumed.sink.close()
