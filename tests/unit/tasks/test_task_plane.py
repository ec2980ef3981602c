"""The task plane's seams: switching task is a config change only, every task's rollouts pass the
learner's checks through the same actor-side code, and tampered math or poker rollouts are quarantined."""

import dataclasses
import random
import re
from pathlib import Path

import pytest
from helpers import commit_rollouts, rollout_bytes
from transformers import AutoTokenizer

from echo2.config import ArithmeticTaskConfig, ConfigError, load_config
from echo2.data.rollouts import Rollout, RolloutLimits, decode_rollouts, validate_rollouts
from echo2.data.store import open_store
from echo2.learner.collector import RolloutCollector
from echo2.learner.verify import TaskVerifier
from echo2.rollout.engines import SamplingParams
from echo2.rollout.engines.transformers import TransformersEngine
from echo2.tasks import make_task

REPO = Path(__file__).resolve().parents[3]
TASK_NAMES = ("arithmetic", "math", "poker")
MAX_NEW = 24


def test_no_code_outside_the_task_plane_branches_on_a_task():
    """Only echo2/tasks/ (and the config schema that names them) may know which tasks exist."""
    literal = re.compile(r"""(==|!=|\bin\b|case)\s*\(?\s*["'](arithmetic|math|poker)["']"""
                         r"""|["'](arithmetic|math|poker)["']\s*(==|!=)""")
    by_class = re.compile(r"\b(Arithmetic|Math|Poker)Task(Config)?\b")
    by_name = re.compile(r"task\.name\s*(==|!=|\bin\b)")
    offenders = []
    for path in (REPO / "echo2").rglob("*.py"):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(("echo2/tasks/", "echo2/config/")):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if literal.search(line) or by_class.search(line) or by_name.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_task_name_selects_the_task_and_old_configs_still_load():
    assert isinstance(load_config(REPO / "configs" / "quickstart.yaml").task, ArithmeticTaskConfig)
    assert load_config(None, ["task.digits=2"]).task.digits == 2  # no name: arithmetic, as before tasks had names
    for name in TASK_NAMES:
        assert make_task(load_config(None, [f"task.name={name}"]).task).name == name
    with pytest.raises(ConfigError, match="task.name must be one of arithmetic, math, poker"):
        load_config(None, ["task.name=chess"])
    with pytest.raises(ConfigError, match="digits: unknown key"):  # another task's field is not silently dropped
        load_config(REPO / "configs" / "quickstart.yaml", ["task.name=poker"])


@pytest.fixture(scope="module")
def engine_and_tokenizer(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    engine = TransformersEngine(tiny_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    from safetensors.torch import load_file

    engine.load_weights(load_file(tiny_model / "model.safetensors").items())
    return engine, tok


def _rollouts(task, engine, tok, n_groups=2, group_size=2, seed=0):
    """What the actor writes: the task plays the episodes with the engine (the actor's sampler)."""
    def sample(prompts, max_new_tokens):
        return [g[0] for g in engine.generate(prompts, SamplingParams(n=1, max_new_tokens=max_new_tokens))]

    problems = task.sample_train(random.Random(seed), n_groups)
    groups = task.rollout_groups(sample, tok, problems, group_size, MAX_NEW)
    return [Rollout(prompt_id=p.id, group_id=f"g{gi}", sample_index=si, prompt_token_ids=e.prompt_token_ids,
                    completion_token_ids=e.completion_token_ids, completion_mask=e.completion_mask,
                    behavior_logprobs=e.behavior_logprobs, reward=e.reward, reward_detail=e.reward_detail,
                    finish_reason=e.finish_reason)
            for gi, (p, g) in enumerate(zip(problems, groups)) for si, e in enumerate(g)]


def _limits(task, tok):
    return RolloutLimits(vocab_size=len(tok), group_size=2, max_completion_tokens=MAX_NEW + task.max_env_tokens,
                         max_prompt_tokens=4096, reward_range=task.reward_range)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_switching_task_is_a_config_change_only(name, engine_and_tokenizer):
    """The same actor and learner code for every task: the rollouts validate and re-score."""
    engine, tok = engine_and_tokenizer
    task = make_task(load_config(None, [f"task.name={name}"]
                                 + (["task.starting_stack=40"] if name == "poker" else [])).task)
    table = validate_rollouts(decode_rollouts(rollout_bytes(1, rollouts=_rollouts(task, engine, tok))), run_id="run",
                              actor_id="a", expected_version=1, learner_version=1, limits=_limits(task, tok))
    TaskVerifier(task, tok, max_new_tokens=MAX_NEW).verify_claims(table)


@pytest.mark.parametrize("name", ["math", "poker"])
def test_tampered_rollouts_are_quarantined(name, engine_and_tokenizer, tmp_path):
    engine, tok = engine_and_tokenizer
    task = make_task(load_config(None, [f"task.name={name}"]
                                 + (["task.starting_stack=40"] if name == "poker" else [])).task)
    honest = _rollouts(task, engine, tok, seed=1)
    lo, hi = task.reward_range
    wrong_reward = [dataclasses.replace(r, reward=hi if r.reward < hi else lo) for r in honest]
    never_issued = [dataclasses.replace(r, prompt_id="eval-0" if name == "math" else "eval-call_station-0-0")
                    for r in honest]
    if name == "poker":  # environment text of the actor's choosing after the first reply
        forged = tok(" Opponent folds. You win.", add_special_tokens=False)["input_ids"]
        injected = []
        for r in honest:
            ids, mask = list(r.completion_token_ids), list(r.completion_mask)
            cut = mask.index(0) if 0 in mask else len(mask)
            ids, mask = ids[:cut] + forged, mask[:cut] + [0] * len(forged)
            injected.append(dataclasses.replace(r, completion_token_ids=ids, completion_mask=mask,
                                                behavior_logprobs=r.behavior_logprobs[:cut] + [0.0] * len(forged)))
    else:  # "environment" tokens in a single-turn task's completion
        injected = [dataclasses.replace(r, completion_mask=[1] + [0] * (len(r.completion_mask) - 1))
                    if len(r.completion_mask) > 1 else r for r in honest]
    store = open_store(str(tmp_path))
    # one actor per file (in key order): a dishonest file bans its actor, and the honest one must be another
    actors = {"reward": "a1-reward", "prompt": "a2-prompt", "injected": "a3-injected", "honest": "a4-honest"}
    keys = {kind: commit_rollouts(store, 1, 0, actor=actors[kind],
                                  data=rollout_bytes(1, rollouts=rows, actor=actors[kind]))
            for kind, rows in [("reward", wrong_reward), ("prompt", never_issued), ("injected", injected),
                               ("honest", honest)]}
    col = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=2, limits=_limits(task, tok),
                           verifier=TaskVerifier(task, tok, max_new_tokens=MAX_NEW))
    sel = col.collect(step=2, learner_version=1, timeout_s=30)
    assert [u["key"] for u in sel.used] == [keys["honest"]]
    reasons = {q["key"]: q["reason"] for q in sel.quarantined}
    assert "the task scores the completion" in reasons[keys["reward"]]
    assert "prompt_id" in reasons[keys["prompt"]]
    assert "environment" in reasons[keys["injected"]] or "end of the hand" in reasons[keys["injected"]]
    assert set(col.banned) == {"a1-reward", "a2-prompt", "a3-injected"}  # their claims were false: out
