"""The poker task: action parsing, hands against every opponent, the completion mask, the learner's
replay, and duplicate evaluation."""

import random
import re
from dataclasses import dataclass

import pytest
from conftest import REPO
from transformers import AutoTokenizer

from echo2.config import ConfigError, load_config
from echo2.tasks import ForgedEpisode, UnknownProblem, make_task, poker_game
from echo2.tasks.poker import _Episode
from echo2.tasks.poker_game import (
    EV_SAMPLES,
    STRENGTH_SAMPLES,
    Action,
    Deal,
    Hand,
    Legal,
    all_in_equity,
    deal,
    hand_strength,
    parse_action,
)

FACING = Legal(to_call=2, can_fold=True, min_raise=8, max_raise=40)
FREE = Legal(to_call=0, can_fold=False, min_raise=2, max_raise=38, verb="bet")


def test_replies_are_parsed_into_legal_actions_or_counted():
    assert parse_action(" call 1.", FACING) == (Action("check_call"), "ok")
    assert parse_action(" raise 12 because", FACING) == (Action("raise", 12), "ok")
    assert parse_action(" Raise to 8", FACING) == (Action("raise", 8), "ok")
    assert parse_action(" raise", FACING) == (Action("raise", 8), "ok")  # no amount: the minimum
    assert parse_action(" all-in!", FACING) == (Action("raise", 40), "ok")
    assert parse_action(" fold", FACING) == (Action("fold"), "ok")
    assert parse_action(" bet 5", FREE) == (Action("raise", 5), "ok")
    assert parse_action(" call", FREE) == (Action("check_call"), "ok")  # nothing to call: a check
    assert parse_action(" raise 4", FACING) == (None, "illegal")  # under the minimum
    assert parse_action(" raise 41", FACING) == (None, "illegal")
    assert parse_action(" check", FACING) == (None, "illegal")
    assert parse_action(" fold", FREE) == (None, "illegal")  # folding when checking is free
    assert parse_action(" I think I call", FACING) == (None, "malformed")  # the action must come first
    assert parse_action(" folding", FACING) == (None, "malformed")
    assert FACING.default() == Action("fold") and FREE.default() == Action("check_call")
    assert FREE.describe() == "check, bet 2-38" and FACING.describe() == "fold, call, raise 8-40"


def test_an_all_in_runs_the_board_out_and_settles():
    h = Hand(deal("all-in"), 40, 1, 2)
    h.play(parse_action(" all in", h.legal())[0])  # the small blind shoves, the big blind calls
    h.play(Action("check_call"))
    assert h.over and sum(h.state.stacks) == 80 and sum(h.state.payoffs) == 0
    assert [line.split(":")[0] for line in h.log[0] if ":" in line] == ["Flop", "Turn", "River"]


def test_deals_are_seeded_and_distinct():
    d = deal("k")
    assert d == deal("k") and d != deal("k2")
    cards = d.holes[0] + d.holes[1] + d.board
    assert len({cards[i:i + 2] for i in range(0, 18, 2)}) == 9


def _task(tmp_path=None, **fields):
    overrides = ["task.name=poker", "task.starting_stack=40", "task.eval_deals=3"]
    overrides += [f"task.{k}={v}" for k, v in fields.items()]
    return make_task(load_config(None, overrides).task)


@dataclass
class Reply:
    token_ids: list
    logprobs: list
    finish_reason: str


class ScriptedSampler:
    """Replies chosen by a seeded generator among legal, illegal and malformed answers; records what it sampled."""

    def __init__(self, tokenizer, seed=0, replies=(" call", " raise 8", " check", " fold", " all in", " hmm")):
        self.tok, self.rng, self.replies = tokenizer, random.Random(seed), replies
        self.sampled: list[list[int]] = []

    def __call__(self, prompts, max_new_tokens):
        out = []
        for _ in prompts:
            ids = self.tok(self.rng.choice(self.replies), add_special_tokens=False)["input_ids"][:max_new_tokens]
            if len(ids) < max_new_tokens:
                ids.append(self.tok.eos_token_id)
            self.sampled.append(ids)
            out.append(Reply(ids, [-0.25] * len(ids), "stop"))
        return out


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.mark.parametrize("opponent", ["random", "call_station", "equity", "checkpoint"])
def test_a_hand_against_each_opponent_ends_with_stacks_that_sum(opponent, tiny_model, tok):
    spec = f"{{kind: {opponent}, path: {tiny_model}}}" if opponent == "checkpoint" else f"{{kind: {opponent}}}"
    task = _task(opponents=f"[{spec}]", max_decisions=6)
    sampler = ScriptedSampler(tok)
    problems = task.sample_train(random.Random(3), 3)
    groups = task.rollout_groups(sampler, tok, problems, 3, 30)
    for problem, group in zip(problems, groups):
        for e in group:
            d = e.reward_detail
            assert d["opponent"] == opponent
            hand = _played(task, tok, problem, e, 30).hand
            assert hand.over and sum(hand.state.stacks) == 2 * 40 and sum(hand.state.payoffs) == 0
            assert hand.payoff(problem.meta["seat"]) == d["chips"] and -40 <= d["chips"] <= 40
            assert e.reward == pytest.approx(d["bb"] - d["illegal"])


def _played(task, tok, problem, episode, budget):
    """The hand of ``episode`` played again from its policy tokens, to its end."""
    played, spent = _Episode(task, problem.meta), 0
    for _, reply in _runs(episode, 1):
        assert played.next_turn(budget - spent) is not None
        played.play_reply(tok.decode(reply, skip_special_tokens=True))
        spent += len(reply)
    assert played.next_turn(budget - spent) is None
    return played


def test_the_completion_mask_covers_exactly_the_policys_tokens(tok):
    task = _task(max_decisions=5)
    sampler = ScriptedSampler(tok, replies=(" call", " check", " raise 8"))
    problems = task.sample_train(random.Random(5), 4)
    groups = task.rollout_groups(sampler, tok, problems, 2, 40)
    episodes = [e for g in groups for e in g]
    policy = [t for e in episodes for t, m in zip(e.completion_token_ids, e.completion_mask) if m == 1]
    assert sorted(policy) == sorted(t for s in sampler.sampled for t in s)
    assert sum(sum(e.completion_mask) for e in episodes) == sum(len(s) for s in sampler.sampled)
    multi = [e for e in episodes if 0 in e.completion_mask]
    assert multi, "some hand must go past the first decision"
    for e in multi:
        env = [t for t, m in zip(e.completion_token_ids, e.completion_mask) if m == 0]
        assert "Cards:" in tok.decode(env) and "My action:" in tok.decode(env)
        assert all(lp == 0.0 for lp, m in zip(e.behavior_logprobs, e.completion_mask) if m == 0)
        assert all(lp == -0.25 for lp, m in zip(e.behavior_logprobs, e.completion_mask) if m == 1)
        assert e.completion_mask[0] == 1 and e.completion_mask[-1] == 1


def test_a_group_shares_its_deal_and_the_learner_replays_every_episode(tok):
    task = _task(max_decisions=4)
    problems = task.sample_train(random.Random(7), 3)
    groups = task.rollout_groups(ScriptedSampler(tok, seed=1), tok, problems, 4, 20)
    for problem, group in zip(problems, groups):
        assert len({tuple(e.prompt_token_ids) for e in group}) == 1  # one deal, one prompt
        issued = task.problem(problem.id)
        assert task.prompt_tokens(tok, issued) == group[0].prompt_token_ids
        scores = task.score_episodes(tok, [issued] * len(group), [e.completion_token_ids for e in group],
                                     [e.completion_mask for e in group], 20)
        assert scores == pytest.approx([e.reward for e in group])


def test_forged_episodes_are_refused_by_the_replay(tok):
    task = _task(max_decisions=4)
    problems = task.sample_train(random.Random(11), 6)
    groups = task.rollout_groups(ScriptedSampler(tok, replies=(" call",)), tok, problems, 1, 20)
    problem, e = next((p, g[0]) for p, g in zip(problems, groups) if 0 in g[0].completion_mask)
    start = e.completion_mask.index(0)

    def score(completion, mask):
        return task.score_episodes(tok, [problem], [completion], [mask], 20)[0]

    forged_text = tok(" Opponent folds.", add_special_tokens=False)["input_ids"]
    injected = e.completion_token_ids[:start] + forged_text + e.completion_token_ids[start + len(forged_text):]
    with pytest.raises(ForgedEpisode, match="environment text"):
        score(injected, e.completion_mask)
    relabelled = list(e.completion_mask)
    relabelled[start] = 1  # claim an environment token as the policy's
    with pytest.raises(ForgedEpisode):
        score(e.completion_token_ids, relabelled)
    with pytest.raises(ForgedEpisode, match="not one the engine stops at"):  # a longer last reply
        score(e.completion_token_ids + [5], e.completion_mask + [1])
    with pytest.raises(ForgedEpisode, match="follow the end"):  # text after the hand is over
        score(e.completion_token_ids + [5], e.completion_mask + [0])
    env_end = e.completion_mask.index(1, start)  # the environment's text, then the reply is cut off
    with pytest.raises(ForgedEpisode, match="no reply"):
        score(e.completion_token_ids[:env_end], e.completion_mask[:env_end])
    with pytest.raises(UnknownProblem):
        task.problem("eval-call_station-0-0")


def test_evaluation_plays_duplicate_deals_against_each_opponent(tok):
    task = _task(eval_opponents="[call_station, random]")
    problems = task.eval_set()
    assert len(problems) == 2 * 3 * 2
    keys = [(p.meta["opponent"], p.meta["key"]) for p in problems]
    assert all(keys.count(k) == 2 for k in keys)  # each deal twice per opponent...
    assert {p.meta["seat"] for p in problems if p.meta["key"] == problems[0].meta["key"]} == {0, 1}  # ...seats swapped
    result = task.evaluate(ScriptedSampler(tok, replies=(" call",)), None, tok, k=1, max_new_tokens=48)
    assert set(result["opponents"]) == {"call_station", "random"}
    # calling every street against a call-station: both seats see the same showdown, so each deal nets 0
    cs = result["opponents"]["call_station"]
    assert cs["bb_per_100"] == 0.0 and cs["illegal_action_rate"] == 0.0 and cs["hands"] == 6
    assert result["illegal_action_rate"] == 0.0
    folds = task.evaluate(ScriptedSampler(tok, replies=(" nonsense",)), None, tok, k=1, max_new_tokens=20)
    assert folds["illegal_action_rate"] == 1.0 and folds["opponents"]["call_station"]["bb_per_100"] < 0


def _torn_policy(src, dst, fold_edge):
    """A frozen policy whose greedy answer is a near tie between " call" and " fold": its final norm keeps one
    hidden unit, in which every token's embedding is 100 and those two are 101 (+ ``fold_edge`` for " fold").
    With ``fold_edge`` 0 the tie is exact (the lower id, " call", wins); a tiny edge stands for the learner's
    copy on another machine, whose kernels round the other way."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens([" call", " fold"])
    model = AutoModelForCausalLM.from_pretrained(src)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    call, fold = tok.convert_tokens_to_ids([" call", " fold"])
    with torch.no_grad():
        embeddings = model.get_input_embeddings().weight  # tied: also the output layer
        embeddings[call:fold + 1] = embeddings[:2]
        embeddings[:, 0] = 100.0
        embeddings[call, 0] = embeddings[fold, 0] = 101.0
        embeddings[fold, 0] += fold_edge
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


class _NothingLeft(Exception):
    pass


def _nothing_left():
    raise _NothingLeft  # the collector has judged every file and waits for more: stop it


def test_a_checkpoint_opponent_at_a_near_tie_sets_the_file_aside_not_its_actor(tiny_model, tok, tmp_path):
    """The actor's frozen opponent calls at an exact tie, the learner's copy folds there: the replay parts from
    the file. After a near tie that is no lie: quarantined, the actor not banned; with ``tie_margin: 0`` (no
    decision counts as a near tie) the same file bans its actor, as every divergence did before."""
    from helpers import commit_rollouts, rollout_bytes

    from echo2.data import layout
    from echo2.data.rollouts import Rollout, RolloutLimits
    from echo2.data.store import open_store
    from echo2.learner.collector import RolloutCollector
    from echo2.learner.verify import TaskVerifier

    on_actor = _torn_policy(tiny_model, tmp_path / "actor-copy", 0.0)
    on_learner = _torn_policy(tiny_model, tmp_path / "learner-copy", 1e-3)

    def task(path, margin):
        return _task(opponents=f"[{{kind: checkpoint, path: {path}, tie_margin: {margin}}}]", max_decisions=4)

    actor = task(on_actor, 0.05)
    problems = actor.sample_train(random.Random(0), 3)
    groups = actor.rollout_groups(ScriptedSampler(tok, replies=(" raise 8",)), tok, problems, 2, 24)
    assert all(reply.startswith(" call") and gap == 0.0 for reply, gap in actor.opponents[0]._replies.values())
    rows = [Rollout(prompt_id=p.id, group_id=f"g{gi}", sample_index=si, prompt_token_ids=e.prompt_token_ids,
                    completion_token_ids=e.completion_token_ids, completion_mask=e.completion_mask,
                    behavior_logprobs=e.behavior_logprobs, reward=e.reward, reward_detail=e.reward_detail,
                    finish_reason=e.finish_reason)
            for gi, (p, g) in enumerate(zip(problems, groups)) for si, e in enumerate(g)]
    limits = RolloutLimits(vocab_size=len(tok), group_size=2, max_completion_tokens=24 + actor.max_env_tokens,
                           max_prompt_tokens=4096, reward_range=actor.reward_range)
    verdicts = {}
    for margin in (0.05, 0.0):
        store = open_store(str(tmp_path / f"store-{margin}"))
        key = commit_rollouts(store, 1, 0, actor="a1", data=rollout_bytes(1, rollouts=rows, actor="a1"))
        learner = task(on_learner, margin)
        collector = RolloutCollector(store, run_id="run", staleness=1, groups_per_step=1, limits=limits,
                                     verifier=TaskVerifier(learner, tok, max_new_tokens=24))
        with pytest.raises(_NothingLeft):  # the only file is set aside: nothing to train on
            collector.collect(step=2, learner_version=1, timeout_s=60, should_abort=_nothing_left)
        verdicts[margin] = (collector.banned, store.get_json(layout.quarantine_reason_key(key))["reason"])
    banned, reason = verdicts[0.05]
    assert not banned and "ungradable" in reason and "near tie" in reason, reason
    banned, reason = verdicts[0.0]
    assert set(banned) == {"a1"} and "near tie" not in reason, reason


class StrengthReader(ScriptedSampler):
    """Goes all in when the last strength line it was told reads at least ``above`` percent, else calls."""

    def __init__(self, tokenizer, above=60):
        super().__init__(tokenizer)
        self.above = above

    def decide(self, text):
        """The reply to the hand so far (``text``: the whole prompt)."""
        told = re.findall(r"Strength (\d+)%", text)
        return " all in" if told and int(told[-1]) >= self.above else " call"

    def __call__(self, prompts, max_new_tokens):
        out = []
        for prompt in prompts:
            reply = self.decide(self.tok.decode(prompt))
            ids = self.tok(reply, add_special_tokens=False)["input_ids"][:max_new_tokens] + [self.tok.eos_token_id]
            out.append(Reply(ids, [-0.25] * len(ids), "stop"))
        return out


def test_the_strength_line_is_the_seeded_estimate_replayed_by_the_learner(tok):
    task = _task(max_decisions=4, show_strength="true")
    problems = task.sample_train(random.Random(7), 4)
    groups = task.rollout_groups(ScriptedSampler(tok, seed=2, replies=(" call", " check")), tok, problems, 2, 20)
    for problem, group in zip(problems, groups):
        first = problem.messages[-1]["content"]
        hole = deal(problem.meta["key"]).holes[problem.meta["seat"]]
        assert f"Strength {round(100 * hand_strength(hole, '', STRENGTH_SAMPLES))}%." in first
        issued = task.problem(problem.id)
        scores = task.score_episodes(tok, [issued] * len(group), [e.completion_token_ids for e in group],
                                     [e.completion_mask for e in group], 20)
        assert scores == pytest.approx([e.reward for e in group])
    later = [tok.decode([t for t, m in zip(e.completion_token_ids, e.completion_mask) if m == 0])
             for g in groups for e in g if 0 in e.completion_mask]
    assert later and all(re.search(r"Strength \d+%", text) for text in later), later
    assert any(re.search(r"Board: \S\S \S\S \S\S.*Strength \d+%", text) for text in later), later  # after a flop
    assert "Strength" not in _task().sample_train(random.Random(7), 1)[0].messages[-1]["content"]  # off by default


def test_betting_the_strong_hands_beats_the_call_station(tok):
    """What the hint is for: a player that goes all in on the hands it is told are strong wins against a
    call-station over duplicate deals, where calling everything nets exactly 0."""
    task = _task(show_strength="true", eval_deals=40, eval_opponents="[call_station]", max_decisions=2,
                 max_action_tokens=12)
    result = task.evaluate(StrengthReader(tok), None, tok, k=1, max_new_tokens=64)
    cs = result["opponents"]["call_station"]
    assert cs["illegal_action_rate"] == 0.0 and cs["bb_per_100"] > 0, cs


def test_push_fold_leaves_the_policy_one_raise_all_in_and_the_opponents_every_size():
    h = Hand(deal("push"), 40, 1, 2, push_fold=True)  # seat 1, the small blind, acts first
    legal = h.legal(push_fold=True)
    assert (legal.min_raise, legal.max_raise) == (40, 40) and legal.describe() == "fold, call, raise 40"
    assert "Legal: fold, call, raise 40." in h.observation(1)
    assert parse_action(" raise 40", legal) == (Action("raise", 40), "ok")
    assert parse_action(" raise", legal) == (Action("raise", 40), "ok")  # no amount: the only size
    assert parse_action(" all in", legal) == (Action("raise", 40), "ok")
    assert parse_action(" raise 4", legal) == (None, "illegal")  # no-limit's minimum is not offered
    assert h.legal().min_raise == 4  # what an opponent in this seat may do: every size
    h.play(Action("check_call"))  # the small blind limps; the big blind (an opponent here) may raise any size
    assert (h.legal().min_raise, h.legal().max_raise) == (4, 40)


def test_push_fold_hands_are_replayed_by_the_learner(tok):
    task = _task(push_fold="true", show_strength="true", max_decisions=3,
                 opponents="[{kind: random}, {kind: call_station}]")
    problems = task.sample_train(random.Random(5), 4)
    sampler = ScriptedSampler(tok, seed=4, replies=(" raise 40", " raise 8", " call", " check", " fold", " raise"))
    groups = task.rollout_groups(sampler, tok, problems, 3, 24)
    policy_text = [tok.decode([t for t, m in zip(e.completion_token_ids, e.completion_mask) if m == 0])
                   for g in groups for e in g]
    assert all("raise 4-" not in text and "bet 2-" not in text for text in policy_text), policy_text
    actions = [a for g in groups for e in g for a in e.reward_detail["actions"]]
    assert "raise 40" in actions and "illegal" in actions, actions  # " raise 8" is not offered
    for problem, group in zip(problems, groups):
        scores = task.score_episodes(tok, [task.problem(problem.id)] * len(group),
                                     [e.completion_token_ids for e in group], [e.completion_mask for e in group], 24)
        assert scores == pytest.approx([e.reward for e in group])


def test_without_flat_calls_the_policy_may_only_check_or_fold_or_go_all_in(tok):
    h = Hand(deal("push"), 40, 1, 2, push_fold=True, flat_calls=False)  # seat 1, the small blind, acts first
    legal = h.legal(push_fold=True, flat_calls=False)
    assert legal.describe() == "fold, raise 40" and "Legal: fold, raise 40." in h.observation(1)
    assert parse_action(" call", legal) == (None, "illegal")  # a flat call is not offered
    assert parse_action(" fold", legal) == (Action("fold"), "ok")
    assert parse_action(" all in", legal) == (Action("raise", 40), "ok")
    assert h.legal().can_call  # the opponent in this seat may still call
    h.play(Action("check_call"))  # (played as the opponent would) the small blind limps
    legal = h.legal(push_fold=True, flat_calls=False)
    assert legal.describe() == "check, raise 40" and parse_action(" call", legal) == (Action("check_call"), "ok")
    assert parse_action(" fold", legal) == (Action("check_call"), "ok")  # the passive word everywhere: it checks
    assert parse_action(" fold", h.legal(push_fold=True)) == (None, "illegal")  # with flat calls it stays illegal
    h.play(Action("raise", 40))  # the big blind goes all in: calling is now all the small blind can do
    legal = h.legal(push_fold=True, flat_calls=False)
    assert legal.describe() == "fold, call" and parse_action(" call", legal) == (Action("check_call"), "ok")
    task = _task(push_fold="true", flat_calls="false", max_decisions=3, max_action_tokens=8,
                 opponents="[{kind: random}, {kind: call_station}]")  # " all in" is 7 tokens of the tiny tokenizer
    problems = task.sample_train(random.Random(5), 6)
    groups = task.rollout_groups(ScriptedSampler(tok, seed=4, replies=(" call", " check", " fold", " all in")), tok,
                                 problems, 3, 24)
    lines = [line for g in groups for e in g for line in re.findall(r"Legal: ([^.]*)\.", tok.decode(e.prompt_token_ids
                                                                                          + e.completion_token_ids))]
    # the passive option and all in (its whole stack, 40 before the flop), or fold / call an all in
    assert lines and all(re.fullmatch(r"(fold|check), (raise|bet) \d+|fold, call", line) for line in lines), lines
    actions = [a for g in groups for e in g for a in e.reward_detail["actions"]]
    assert "illegal" in actions and "raise 40" in actions, sorted(set(actions))  # a flat " call" is illegal
    for problem, group in zip(problems, groups):
        scores = task.score_episodes(tok, [task.problem(problem.id)] * len(group),
                                     [e.completion_token_ids for e in group], [e.completion_mask for e in group], 24)
        assert scores == pytest.approx([e.reward for e in group])
    with pytest.raises(ConfigError, match="flat_calls: false is the push-or-fold game: it needs push_fold: true"):
        _task(flat_calls="false")


class PushOrFold(StrengthReader):
    """Goes all in when the last strength line it was told says ``strong``, else checks when free, else folds."""

    def decide(self, text):
        strong = re.findall(r"Strength \d+%, (strong|weak)", text)[-1] == "strong"
        free = re.findall(r"to call (\d+)", text)[-1] == "0"
        return " all in" if strong else " check" if free else " fold"


def test_the_rule_the_shipped_poker_config_teaches_beats_both_opponents_over_its_evaluation(tok, monkeypatch):
    """What configs/poker-smollm2.yaml's policy has to find, and that the config's evaluation (its ``eval_deals``
    duplicate deals per opponent) shows it: all in when told ``strong``, else check or fold, wins against the
    call-station and the random player with both intervals above 0. The game is the config's; the reply budget is
    widened for the test tokenizer (" all in" is 7 of its tokens, one of SmolLM2's), and the strength line is drawn
    from 50 samples, not 200: the same verdict in a quarter of the time."""
    monkeypatch.setattr(poker_game, "STRENGTH_SAMPLES", 50)
    config = load_config(REPO / "configs" / "poker-smollm2.yaml", ["task.max_action_tokens=12"])
    task = make_task(config.task)
    result = task.evaluate(PushOrFold(tok), None, tok, k=1, max_new_tokens=24)
    assert result["illegal_action_rate"] == 0.0 and result["n"] == 2 * 2 * config.task.eval_deals, result
    for name in ("call_station", "random"):
        assert result["opponents"][name]["ci95_low"] > 0, result["opponents"]


def test_an_all_in_pays_its_expectation_over_the_undealt_cards():
    assert all_in_equity("AsAh", "KsKh", "2c7d9hJc") == pytest.approx(42 / 44)  # only the two kings left beat aces
    pre = all_in_equity("8cKd", "3dJc", "")
    assert pre + all_in_equity("3dJc", "8cKd", "") == pytest.approx(1.0) and 0.5 < pre < 0.75
    h = Hand(deal("all-in"), 40, 1, 2)  # seat 1 (small blind) holds 3dJc, seat 0 8cKd; the board gives seat 0 the pot
    h.play(Action("raise", 40))
    h.play(Action("check_call"))
    assert h.over and h.all_in == ("", 40) and (h.payoff(0), h.payoff(1)) == (40, -40)
    assert h.expected_payoff(0) == pytest.approx((2 * pre - 1) * 40) == -h.expected_payoff(1)
    calm = Hand(deal("all-in"), 40, 1, 2)
    calm.play(Action("fold"))
    assert calm.all_in is None and calm.expected_payoff(1) == calm.payoff(1) == -1


def test_all_in_ev_rewards_are_what_the_learner_replays_and_evaluation_counts_chips(tok):
    task = _task(push_fold="true", all_in_ev="true", max_decisions=2, max_action_tokens=12,
                 opponents="[{kind: call_station}]")
    problems = task.sample_train(random.Random(11), 3)
    groups = task.rollout_groups(ScriptedSampler(tok, seed=1, replies=(" raise 40", " call")), tok, problems, 4, 24)
    shoved = [e for g in groups for e in g if "all_in_ev_bb" in e.reward_detail]
    assert shoved, "no hand went all in"
    for e in shoved:
        d = e.reward_detail
        assert e.reward == pytest.approx(d["all_in_ev_bb"] - d["illegal"]) and d["bb"] in (-20, 0, 20)
    for problem, group in zip(problems, groups):
        scores = task.score_episodes(tok, [task.problem(problem.id)] * len(group),
                                     [e.completion_token_ids for e in group], [e.completion_mask for e in group], 24)
        assert scores == pytest.approx([e.reward for e in group])


def test_the_strength_line_says_strong_or_weak_at_the_configured_percent():
    d = deal("push")
    percent = round(100 * hand_strength(d.holes[1], "", STRENGTH_SAMPLES))
    for above, word in ((percent, "strong"), (percent + 1, "weak")):
        hand = Hand(d, 40, 1, 2, show_strength=True, strong_above=above)
        assert f"Strength {percent}%, {word}. " in hand.observation(1)
    assert f"Strength {percent}%. " in Hand(d, 40, 1, 2, show_strength=True).observation(1)  # no word by default


def test_a_shuffled_legal_line_lists_the_same_actions_in_an_order_drawn_from_the_deal(tok):
    lines = []
    for k in range(12):
        d = deal(f"shuffle-{k}")
        hand = Hand(d, 40, 1, 2, push_fold=True, shuffle_legal=True)
        line = hand.observation(1).splitlines()[-1]
        assert line == Hand(d, 40, 1, 2, push_fold=True, shuffle_legal=True).observation(1).splitlines()[-1]  # seeded
        assert sorted(line.removeprefix("Legal: ").rstrip(".").split(", ")) == ["call", "fold", "raise 40"]
        lines.append(line)
    assert len(set(lines)) > 1 and "Legal: fold, call, raise 40." in Hand(deal("shuffle-0"), 40, 1, 2,
                                                                           push_fold=True).observation(1)
    task = _task(push_fold="true", shuffle_legal="true", max_decisions=2)  # the learner replays the same text
    problems = task.sample_train(random.Random(3), 3)
    sampler = ScriptedSampler(tok, seed=2, replies=(" raise 40", " call", " fold"))
    for problem, group in zip(problems, task.rollout_groups(sampler, tok, problems, 2, 24)):
        scores = task.score_episodes(tok, [task.problem(problem.id)] * len(group),
                                     [e.completion_token_ids for e in group], [e.completion_mask for e in group], 24)
        assert scores == pytest.approx([e.reward for e in group])


def test_without_all_in_ev_an_all_in_hand_is_rewarded_and_told_in_chips_dealt(tok):
    task = _task(push_fold="true", max_decisions=2, max_action_tokens=12, opponents="[{kind: call_station}]")
    problems = task.sample_train(random.Random(11), 3)
    groups = task.rollout_groups(ScriptedSampler(tok, seed=1, replies=(" raise 40",)), tok, problems, 2, 24)
    for e in (e for g in groups for e in g):
        assert "all_in_ev_bb" not in e.reward_detail and e.reward == e.reward_detail["bb"] in (-20, 0, 20)


def test_a_strength_margin_trains_on_clear_cases_only_and_the_learner_refuses_the_rest(tok):
    task = _task(show_strength="true", strong_above=50, train_strength_margin=10, push_fold="true")
    problems = task.sample_train(random.Random(5), 12)
    told = [int(re.search(r"Strength (\d+)%", p.messages[-1]["content"]).group(1)) for p in problems]
    assert all(t <= 40 or t >= 60 for t in told), told
    assert [t >= 60 for t in told[1:]] == [t < 60 for t in told[:-1]]  # strong and weak in turn: batches balance
    firsts = {task.sample_train(random.Random(seed), 1)[0].meta["strength"] >= 60 for seed in range(8)}
    assert firsts == {True, False}  # a batch of one deal is either side
    assert [task.problem(p.id).messages for p in problems] == [p.messages for p in problems]
    plain = _task(show_strength="true", strong_above=50, push_fold="true")
    close = next(p for n in range(200) if (p := plain._train_problem(n)).messages and 40 < p.meta["strength"] < 60)
    with pytest.raises(UnknownProblem, match="within train_strength_margin 10 of strong_above 50"):
        task.problem(close.id)  # an actor cannot train the learner on a deal the curriculum never issues
    assert any(40 < (p.meta["strength"] or 0) < 60 for p in task.eval_set())  # evaluation plays every deal
    with pytest.raises(ConfigError, match="train_strength_margin .* needs show_strength: true and strong_above"):
        _task(show_strength="true", train_strength_margin=10)


def _runs(episode, kind):
    """The completion's runs of environment (kind 0) or policy (kind 1) tokens, with their start."""
    out, start = [], None
    for k, m in enumerate(episode.completion_mask + [1 - kind]):
        if m == kind and start is None:
            start = k
        elif m != kind and start is not None:
            out.append((start, episode.completion_token_ids[start:k]))
            start = None
    return out


def test_an_answer_prefix_names_the_strength_word_of_each_decision_and_the_replay_checks_it(tok):
    prefix = '"My hand is {strength}. My action:"'
    task = _task(max_decisions=4, show_strength="true", strong_above=50, answer_prefix=prefix)
    problems = task.sample_train(random.Random(7), 6)
    groups = task.rollout_groups(ScriptedSampler(tok, seed=2, replies=(" call", " check")), tok, problems, 2, 20)
    words = set()
    for problem, group in zip(problems, groups):
        told = int(re.search(r"Strength (\d+)%, (strong|weak)", problem.messages[-1]["content"]).group(1))
        word = "strong" if told >= 50 else "weak"
        words.add(word)
        assert tok.decode(group[0].prompt_token_ids).endswith(f"My hand is {word}. My action:")
        assert task.prompt_tokens(tok, task.problem(problem.id)) == group[0].prompt_token_ids
        for e in group:
            for _, env in _runs(e, 0):  # every later decision: the word of the strength line just told
                text = tok.decode(env)
                told_word = re.findall(r"Strength \d+%, (strong|weak)", text)[-1]
                assert text.endswith(f"My hand is {told_word}. My action:"), text
        scores = task.score_episodes(tok, [task.problem(problem.id)] * len(group),
                                     [e.completion_token_ids for e in group], [e.completion_mask for e in group], 20)
        assert scores == pytest.approx([e.reward for e in group])
    assert words == {"strong", "weak"}
    problem, e = next((p, e) for p, g in zip(problems, groups) for e in g if 0 in e.completion_mask)
    start, env = _runs(e, 0)[0]
    text = tok.decode(env)
    said = re.findall(r"My hand is (strong|weak)", text)[-1]
    at = text.rindex(said)
    other = {"strong": "weak", "weak": "strong"}[said]
    forged = tok(text[:at] + other + text[at + len(said):], add_special_tokens=False)["input_ids"]
    end = start + len(env)
    with pytest.raises(ForgedEpisode, match="environment text"):  # an actor cannot tell its policy the other word
        task.score_episodes(tok, [task.problem(problem.id)], [e.completion_token_ids[:start] + forged +
                                                              e.completion_token_ids[end:]],
                            [e.completion_mask[:start] + [0] * len(forged) + e.completion_mask[end:]], 20)
    with pytest.raises(ConfigError, match="answer_prefix names {strength}.* needs show_strength: true"):
        _task(show_strength="true", answer_prefix=prefix)


def test_a_showdown_is_worth_the_same_whichever_hand_a_card_blind_opponent_held():
    """opponent_cards_ev: two deals alike but for the opponent's cards pay the same expectation, where the chips
    dealt go opposite ways; a fold pays its chips."""
    board = "2c7d9hJc3s"
    ahead, behind = (Hand(Deal(holes=("AsAh", other), board=board), 40, 1, 2) for other in ("5d4h", "7s7h"))
    for h in (ahead, behind):  # the small blind (seat 1) limps, the big blind checks it down
        while not h.over:
            h.play(Action("check_call"))
        assert h.showdown == (board, 2) and h.all_in is None
    assert (ahead.payoff(0), behind.payoff(0)) == (2, -2)
    assert ahead.opponent_cards_payoff(0) == behind.opponent_cards_payoff(0) == pytest.approx(
        (2 * hand_strength("AsAh", board, EV_SAMPLES) - 1) * 2)
    shoved = [Hand(Deal(holes=("AsAh", other), board=board), 40, 1, 2) for other in ("5d4h", "7s7h")]
    for h in shoved:
        h.play(Action("raise", 40))
        h.play(Action("check_call"))
        assert h.all_in == ("", 40) and h.showdown is None
    assert shoved[0].opponent_cards_payoff(0) == shoved[1].opponent_cards_payoff(0) == pytest.approx(
        (2 * hand_strength("AsAh", "", EV_SAMPLES) - 1) * 40)
    folded = Hand(Deal(holes=("AsAh", "KsKh"), board=board), 40, 1, 2)
    folded.play(Action("fold"))
    assert folded.showdown is None and folded.opponent_cards_payoff(1) == folded.payoff(1) == -1


def test_opponent_cards_ev_rewards_are_what_the_learner_replays_and_only_card_blind_opponents_train(tok):
    task = _task(push_fold="true", opponent_cards_ev="true", show_strength="true", max_decisions=2,
                 max_action_tokens=12, opponents="[{kind: call_station}, {kind: random}]")
    problems = task.sample_train(random.Random(11), 6)
    groups = task.rollout_groups(ScriptedSampler(tok, seed=1, replies=(" raise 40", " call", " fold")), tok,
                                 problems, 4, 24)
    episodes = [e for g in groups for e in g]
    for e in episodes:
        d = e.reward_detail
        assert e.reward == pytest.approx(d["opponent_cards_ev_bb"] - d["illegal"])
    assert any(e.reward_detail["opponent_cards_ev_bb"] != e.reward_detail["bb"] for e in episodes)
    assert any("fold" in e.reward_detail["actions"] and e.reward_detail["opponent_cards_ev_bb"] == e.reward_detail["bb"]
               for e in episodes)
    for problem, group in zip(problems, groups):
        scores = task.score_episodes(tok, [task.problem(problem.id)] * len(group),
                                     [e.completion_token_ids for e in group], [e.completion_mask for e in group], 24)
        assert scores == pytest.approx([e.reward for e in group])
    evaluated = [g[0] for g in task.rollout_groups(ScriptedSampler(tok, seed=1, replies=(" raise 40", " call")), tok,
                                                   task.eval_set(), 1, 24, chips=True)]  # as evaluate() plays them
    assert all(e.reward == e.reward_detail["bb"] - e.reward_detail["illegal"] and "opponent_cards_ev_bb" not in
               e.reward_detail for e in evaluated)  # chips dealt: no Monte Carlo spent on an expectation
    with pytest.raises(ConfigError, match=r"opponent_cards_ev .* training opponents \['equity'\]"):
        _task(opponent_cards_ev="true", opponents="[{kind: call_station}, {kind: equity}]")
    _task(opponent_cards_ev="true", opponents="[{kind: call_station}, {kind: equity, weight: 0}]")  # evaluated only
