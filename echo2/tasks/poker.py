"""``poker``: heads-up No-Limit Texas Hold'em against scripted or frozen opponents, one hand per episode.

A problem is a deal: training deal ``h<n>`` draws its cards from ``random.Random(f"echo2-poker:{seed}:
train:{n}")``, seats the policy in seat ``n % 2`` (big blind / small blind) and picks its opponent by
the configured weights with a generator seeded the same way. GRPO's group plays one deal G times, so
advantages compare decisions on the same cards against the same opponent. Deals in which the
opponent folds before the policy acts are never issued for training.

The episode is the whole hand, as one growing token sequence:

    prompt:      chat(system rules, user: opening + first observation) + answer_prefix ({strength}: its word)
    completion:  reply_1 | env_1 | reply_2 | env_2 | ... | reply_n
    env_k:       end of the assistant turn + user: what happened + the state + legal actions
                 + start of the assistant turn + answer_prefix                (completion_mask 0)

Each reply is sampled (at most ``max_action_tokens``; the hand at most ``rollout.max_new_tokens``)
with the whole sequence so far as its prompt, so the learner's teacher-forced log-probabilities see
exactly what the actor's engine saw. Replies are read by ``poker_game.parse_action``. A malformed or
illegal reply plays the default action (check when free, else fold) and costs
``illegal_penalty`` big blinds; decisions past ``max_decisions`` or the token budget play the default
unpenalized. Reward = chips won / big blind - penalties, in [-stack/bb - penalty x max_decisions,
stack/bb]; with ``all_in_ev`` a hand that went all in with cards to come counts its chips' expectation
over the undealt cards (``poker_game.all_in_equity``) instead of the runout dealt; with ``opponent_cards_ev`` a
showdown or an all in counts its expectation over the opponent's hole cards too
(``poker_game.Hand.opponent_cards_payoff``). With ``push_fold`` the
policy's only raise is all in (the opponents keep every size), and with ``flat_calls: false`` it
never calls short of all in either: push-or-fold. The chat joints (how a turn ends and
the next begins) are read off the model's own chat template, so any chat model works.

Verification (``score_episodes``, run by the learner on every row): the deal, seat and opponent are
re-derived from the prompt id; the hand is replayed from the completion's policy tokens alone (the
mask-1 runs between the environment's texts), the opponent's actions are recomputed, every
environment run must be token for token the text this task writes at that point, every reply must
respect the per-decision limit (a reply shorter than the limit must end with end-of-sequence, as
the engine stops only there), nothing may follow the end of the hand, and the reward is recomputed
from pokerkit's payoffs. So an actor can neither claim chips it did not win nor write environment
text of its choice; what it chooses is only the policy's own tokens (as in any task). With a
``checkpoint`` opponent the replay reruns the frozen policy greedily (see ``poker_opponents.py``):
where one of its decisions was a near tie (``tie_margin``), the learner's copy may honestly have chosen
otherwise than the actor's, so a replay that parts from the file (other environment text, another
reward) after such a decision raises ``Ungradable`` (the file is set aside) instead of ``ForgedEpisode``.

Evaluation: every opponent plays ``eval_deals`` deals of another seed stream twice, seats swapped
(duplicate poker: each side holds each hand once, which cancels the luck of the cards), with the
policy greedy. Per opponent: bb/100 = mean chips won per hand / bb x 100, with a 95% normal
interval over the per-deal sums; ``illegal_action_rate`` = malformed or illegal replies / replies.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any, Sequence

from echo2.config import PokerTaskConfig
from echo2.tasks.base import (
    REWARD_TOLERANCE,
    Episode,
    ForgedEpisode,
    Problem,
    Sampler,
    Task,
    Ungradable,
    UnknownProblem,
)
from echo2.tasks.poker_game import BIG_BLIND_SEAT, Hand, answer_prefix, deal, is_strong, parse_action
from echo2.tasks.poker_opponents import make_opponent, opponent_names

SYSTEM = "Heads-up No-Limit Hold'em. Answer with one legal action: fold, check, call, or raise N."
ENV_TURN_TOKENS = 512
"""Most tokens one environment text may take (a few lines; checked when it is written)."""
_TRAIN_ID = re.compile(r"h(0|[1-9]\d{0,8})")
_MARKS = ("QQUSERQQ", "QQREPLYQQ", "QQNEXTQQ")


class PokerTask(Task):
    name = "poker"
    headline = "bb_per_100"

    def __init__(self, config: PokerTaskConfig):
        if config.small_blind > config.big_blind:
            raise ValueError(f"task.small_blind {config.small_blind} is larger than task.big_blind {config.big_blind}")
        self.config = config
        self.bb = config.big_blind
        self.reward_range = (-config.starting_stack / self.bb - config.illegal_penalty * config.max_decisions,
                             config.starting_stack / self.bb)
        self.max_env_tokens = (config.max_decisions - 1) * ENV_TURN_TOKENS
        self.opponents = [make_opponent(c, system=SYSTEM, answer_prefix=config.answer_prefix,
                                        max_tokens=config.max_action_tokens) for c in config.opponents]
        self.opponent_names = opponent_names(config.opponents)
        weights = [c.weight for c in config.opponents]
        if sum(weights) <= 0:
            raise ValueError("task.opponents: at least one opponent needs a weight above 0")
        self._weights = weights
        unknown = sorted(set(config.eval_opponents or ()) - set(self.opponent_names))
        if unknown:
            raise ValueError(f"task.eval_opponents names {unknown}, not among the opponents {self.opponent_names}")
        self.eval_opponents = [i for i, name in enumerate(self.opponent_names)
                               if config.eval_opponents is None or name in config.eval_opponents]
        self._joints: dict[int, tuple[str, str]] = {}
        self._eval: list[Problem] | None = None

    # -- problems --------------------------------------------------------------------------
    def _key(self, stream: str, n: int) -> str:
        return f"echo2-poker:{self.config.seed}:{stream}:{n}"

    def _make(self, prompt_id: str, key: str, seat: int, opponent: int) -> Problem:
        meta = {"key": key, "seat": seat, "opponent": opponent}
        episode = _Episode(self, meta)
        first = episode.first_text
        meta["strength"] = episode.hand.told_strength  # at the policy's first decision (None: never told)
        messages = () if first is None else ({"role": "system", "content": SYSTEM}, {"role": "user", "content": first})
        return Problem(id=prompt_id, messages=messages, answer=None, meta=meta,
                       may_differ=f"the {episode.opponent_name} opponent decided at a near tie before the policy's "
                                  f"first turn" if episode.near_tie else None)

    def _train_problem(self, n: int) -> Problem:
        opponent = random.Random(f"{self._key('train', n)}:opponent").choices(
            range(len(self.opponents)), weights=self._weights)[0]
        return self._make(f"h{n}", self._key("train", n), n % 2, opponent)

    def _too_close(self, problem: Problem) -> bool:
        """Whether ``train_strength_margin`` keeps this deal out of training (told too near ``strong_above``)."""
        margin, strength = self.config.train_strength_margin, problem.meta["strength"]
        return margin is not None and strength is not None and abs(strength - self.config.strong_above) < margin

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        """``n`` deals in which the policy acts; with ``train_strength_margin``, clear cases only, strong and weak
        in turn (a batch of a few groups drawn at random is often all of one side, and then its update moves
        every hand one way)."""
        out: list[Problem] = []
        strong_first = rng.random() < 0.5  # a batch of one deal is either side, at even odds
        while len(out) < n:
            problem = self._train_problem(rng.randrange(10**9))
            if not problem.messages or self._too_close(problem):  # the policy never acts, or a case too close
                continue
            wanted_strong = (len(out) % 2 == 0) == strong_first  # strong and weak in turn
            if (self.config.train_strength_margin is not None
                    and is_strong(problem.meta["strength"], self.config.strong_above) != wanted_strong):
                continue
            out.append(problem)
        return out

    def problem(self, prompt_id: str) -> Problem:
        m = _TRAIN_ID.fullmatch(prompt_id)
        if m is None:
            raise UnknownProblem(f"prompt_id {prompt_id[:40]!r} is not a training deal 'h<n>'")
        problem = self._train_problem(int(m.group(1)))
        if not problem.messages:
            if problem.may_differ:  # here the hand ended before the policy's turn; on the actor's machine maybe not
                raise Ungradable(f"prompt_id {prompt_id!r}: the policy never acts here, but {problem.may_differ}")
            raise UnknownProblem(f"prompt_id {prompt_id!r} is a deal in which the policy never acts")
        if self._too_close(problem):
            raise UnknownProblem(f"prompt_id {prompt_id!r} is a deal told {problem.meta['strength']}%, within "
                                 f"train_strength_margin {self.config.train_strength_margin} of strong_above "
                                 f"{self.config.strong_above}: never issued for training")
        return problem

    def eval_set(self) -> list[Problem]:
        """Every opponent x every evaluation deal x both seats (no training deal: another seed stream)."""
        if self._eval is None:
            self._eval = [self._make(f"eval-{self.opponent_names[o]}-{i}-{seat}", self._key("eval", i), seat, o)
                          for o in self.eval_opponents for i in range(self.config.eval_deals)
                          for seat in (0, 1)]
        return list(self._eval)

    def reward(self, problem: Problem, completion: str) -> tuple[float, dict[str, Any]]:
        raise NotImplementedError("poker is multi-turn: episodes are played by rollout_groups")

    def prompt_tokens(self, tokenizer: Any, problem: Problem) -> list[int]:
        text = tokenizer.apply_chat_template(list(problem.messages), tokenize=False, add_generation_prompt=True)
        prefix = answer_prefix(self.config.answer_prefix, problem.meta.get("strength"), self.config.strong_above)
        return tokenizer(text + prefix, add_special_tokens=False)["input_ids"]

    # -- episodes --------------------------------------------------------------------------
    def chat_joints(self, tokenizer: Any) -> tuple[str, str]:
        """(after a reply, before the next user text; after the user text, before the next reply), from the template."""
        if id(tokenizer) not in self._joints:
            user, reply, nxt = _MARKS
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user},
                 {"role": "assistant", "content": reply}, {"role": "user", "content": nxt}],
                tokenize=False, add_generation_prompt=True)
            after_reply = text[text.index(reply) + len(reply):text.index(nxt)]
            after_user = text[text.index(nxt) + len(nxt):]
            self._joints[id(tokenizer)] = (after_reply, after_user)
        return self._joints[id(tokenizer)]

    def env_tokens(self, tokenizer: Any, observation: str, reply_ended: bool, prefix: str) -> list[int]:
        """The environment's text before the policy's next reply (``prefix``: its answer prefix), as tokens."""
        after_reply, after_user = self.chat_joints(tokenizer)
        eos = tokenizer.eos_token or ""
        if reply_ended and eos and after_reply.startswith(eos):
            after_reply = after_reply[len(eos):]  # the reply's end-of-sequence token already closed the turn
        ids = tokenizer(after_reply + observation + after_user + prefix,
                        add_special_tokens=False)["input_ids"]
        if len(ids) > ENV_TURN_TOKENS:
            raise RuntimeError(f"an environment text of {len(ids)} tokens is over ENV_TURN_TOKENS={ENV_TURN_TOKENS}")
        return ids

    def rollout_groups(self, sample: Sampler, tokenizer: Any, problems: Sequence[Problem], group_size: int,
                       max_new_tokens: int, *, chips: bool = False) -> list[list[Episode]]:
        """Play every episode of every group together: each round, one sampler call per reply limit. ``chips``:
        reward the chips dealt even where ``all_in_ev``/``opponent_cards_ev`` train on expectations (evaluation,
        which counts chips, then spends nothing on their Monte Carlo)."""
        eos = tokenizer.eos_token_id
        runs = []
        for problem in problems:
            prompt = self.prompt_tokens(tokenizer, problem) if problem.messages else []
            for _ in range(group_size):
                runs.append(_Run(_Episode(self, problem.meta, chips=chips), prompt))
        active = list(runs)
        while active:
            waiting: dict[int, list[_Run]] = {}
            for run in active:
                turn = run.episode.next_turn(max_new_tokens - run.policy_tokens)
                if turn is None:
                    continue
                cap, observation = turn
                if observation is not None:
                    run.add(self.env_tokens(tokenizer, observation, run.reply_ended, run.episode.answer_prefix), None,
                            policy=False)
                waiting.setdefault(cap, []).append(run)
            active = [run for group in waiting.values() for run in group]
            for cap, group in waiting.items():
                for run, s in zip(group, sample([run.prompt + run.completion for run in group], cap)):
                    ids = list(s.token_ids)
                    run.add(ids, s.logprobs, policy=True)
                    run.reply_ended = bool(ids) and ids[-1] == eos
                    run.episode.play_reply(tokenizer.decode(ids, skip_special_tokens=True))
        episodes = [run.finish() for run in runs]
        return [episodes[i * group_size:(i + 1) * group_size] for i in range(len(problems))]

    def score_episodes(self, tokenizer: Any, problems: Sequence[Problem], completions: Sequence[list[int]],
                       masks: Sequence[list[int]], max_new_tokens: int,
                       claimed: Sequence[float] | None = None) -> list[float]:
        out = []
        for row, (p, c, m) in enumerate(zip(problems, completions, masks)):
            episode = _Episode(self, p.meta)
            try:
                score = self._replay(tokenizer, episode, c, m, max_new_tokens, row)
            except ForgedEpisode as exc:
                if episode.near_tie:
                    raise Ungradable(f"{exc}, after a near tie of the {episode.opponent_name} opponent: its copy on "
                                     f"another machine may have decided otherwise") from None
                raise
            if claimed is not None and abs(score - claimed[row]) > REWARD_TOLERANCE and episode.near_tie:
                raise Ungradable(f"row {row}: the replay scores {score:g}, not {claimed[row]:g}, after a near tie of "
                                 f"the {episode.opponent_name} opponent: its copy on another machine may have decided "
                                 f"otherwise")
            out.append(score)
        return out

    def _replay(self, tokenizer: Any, episode: _Episode, completion: list[int], mask: list[int], budget: int,
                row: int) -> float:
        eos = tokenizer.eos_token_id
        pos, reply_ended, spent = 0, False, 0
        while True:
            turn = episode.next_turn(budget - spent)
            if turn is None:
                break
            cap, observation = turn
            if observation is not None:
                expected = self.env_tokens(tokenizer, observation, reply_ended, episode.answer_prefix)
                if completion[pos:pos + len(expected)] != expected or any(mask[pos:pos + len(expected)]):
                    raise ForgedEpisode(f"row {row}: the environment text at token {pos} is not what the task writes")
                pos += len(expected)
            end = pos
            while end < len(mask) and mask[end] == 1:
                end += 1
            reply = completion[pos:end]
            if not reply:
                raise ForgedEpisode(f"row {row}: the hand goes on at token {pos} but the completion has no reply there")
            if len(reply) > cap or (len(reply) < cap and reply[-1] != eos) or eos in reply[:-1]:
                raise ForgedEpisode(f"row {row}: a reply of {len(reply)} tokens at token {pos} is not one the engine "
                                    f"stops at (limit {cap}, end-of-sequence only last)")
            reply_ended = reply[-1] == eos
            episode.play_reply(tokenizer.decode(reply, skip_special_tokens=True))
            spent += len(reply)
            pos = end
        if pos != len(completion):
            raise ForgedEpisode(f"row {row}: {len(completion) - pos} tokens follow the end of the hand")
        return episode.reward()

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self, greedy: Sampler, sampled: Sampler | None, tokenizer: Any, *, k: int,
                 max_new_tokens: int) -> dict[str, Any]:
        problems = self.eval_set()
        episodes = [g[0] for g in self.rollout_groups(greedy, tokenizer, problems, 1, max_new_tokens, chips=True)]
        per: dict[str, dict[str, Any]] = {}
        replies = illegal = 0
        for name in [self.opponent_names[o] for o in self.eval_opponents]:
            mine = [(p, e) for p, e in zip(problems, episodes) if p.id.startswith(f"eval-{name}-")]
            by_deal: dict[str, float] = {}
            for p, e in mine:
                by_deal[p.meta["key"]] = by_deal.get(p.meta["key"], 0.0) + e.reward_detail["bb"]
            sums = list(by_deal.values())
            mean = sum(sums) / len(sums)
            sd = math.sqrt(sum((x - mean) ** 2 for x in sums) / (len(sums) - 1)) if len(sums) > 1 else 0.0
            half = 1.96 * sd / math.sqrt(len(sums))
            n_replies = sum(e.reward_detail["replies"] for _, e in mine)
            n_illegal = sum(e.reward_detail["illegal"] for _, e in mine)
            replies, illegal = replies + n_replies, illegal + n_illegal
            # a deal's two hands sum to `mean` bb: per hand mean / 2, per 100 hands x 100
            per[name] = {"bb_per_100": mean / 2 * 100, "ci95_low": (mean - half) / 2 * 100,
                         "ci95_high": (mean + half) / 2 * 100, "hands": len(mine),
                         "illegal_action_rate": n_illegal / n_replies if n_replies else 0.0}
        samples = [{"problem": p.id, "completion": tokenizer.decode(e.completion_token_ids), "detail": e.reward_detail}
                   for p, e in list(zip(problems, episodes))[:2]]
        return {"bb_per_100": sum(o["bb_per_100"] for o in per.values()) / len(per),
                "illegal_action_rate": illegal / replies if replies else 0.0, "n": len(problems),
                "opponents": per, "samples": samples}


class _Episode:
    """The environment side of one hand, from the policy's seat: opponents, forced and penalized decisions."""

    def __init__(self, task: PokerTask, meta: dict, *, chips: bool = False):
        c = task.config
        self.config = c
        self.chips = chips
        """Reward the chips dealt, whatever ``all_in_ev``/``opponent_cards_ev`` say (evaluation)."""
        self.bb = task.bb
        self.key, self.seat = meta["key"], meta["seat"]
        self.opponent = task.opponents[meta["opponent"]]
        self.opponent_name = task.opponent_names[meta["opponent"]]
        self.hand = Hand(deal(self.key), c.starting_stack, c.small_blind, c.big_blind, c.show_strength, c.push_fold,
                         c.strong_above, c.shuffle_legal, c.flat_calls)
        self.decisions = self.replies = self.illegal = self.forced = 0
        self.actions: list[str] = []
        self.near_tie = False
        """Whether an opponent decision so far was a near tie (``Opponent.decide``)."""
        self._opponents_play()
        self.first_text = (None if self.hand.over
                           else f"{self.hand.opening(self.seat)}\n{self.hand.observation(self.seat)}")
        self.answer_prefix = ""
        """What the environment writes before the policy's next reply (``answer_prefix``, its strength word filled)."""
        if self.first_text is not None:
            self._set_answer_prefix()
        self._started = False

    def _set_answer_prefix(self) -> None:
        """After the policy's observation (which told its strength)."""
        self.answer_prefix = answer_prefix(self.config.answer_prefix, self.hand.told_strength, self.config.strong_above)

    def _opponents_play(self) -> None:
        while not self.hand.over and self.hand.to_act != self.seat:
            action, near_tie = self.opponent.decide(self.hand, 1 - self.seat, self.key)
            self.near_tie = self.near_tie or near_tie
            self.hand.play(action)

    def next_turn(self, budget_left: int) -> tuple[int, str | None] | None:
        """The next reply the policy owes: (token limit, the observation before it; None for the first), or
        None when the hand is over. Decisions past max_decisions or the token budget play the default."""
        while not self.hand.over:
            if self.decisions >= self.config.max_decisions or budget_left <= 0:
                self.decisions += 1
                self.forced += 1
                self.actions.append("forced")
                self.hand.play(self.hand.legal().default())
                self._opponents_play()
                continue
            if self._started:
                observation = self.hand.observation(self.seat)
                self._set_answer_prefix()
            else:
                observation = None
            self._started = True
            return min(self.config.max_action_tokens, budget_left), observation
        return None

    def play_reply(self, text: str) -> None:
        legal = self.hand.legal(self.config.push_fold, self.config.flat_calls)
        action, verdict = parse_action(text, legal)
        self.decisions += 1
        self.replies += 1
        if action is None:
            self.illegal += 1
            action = legal.default()
            self.hand.log[self.seat].append(f"Your answer was {verdict}; the default action was played.")
        self.actions.append(verdict if verdict != "ok" else action.kind if action.kind != "raise"
                            else f"raise {action.amount}")
        self.hand.play(action)
        self._opponents_play()

    def reward(self) -> float:
        if self.chips:
            chips = float(self.hand.payoff(self.seat))
        elif self.config.opponent_cards_ev:
            chips = self.hand.opponent_cards_payoff(self.seat)
        else:
            chips = self.hand.expected_payoff(self.seat) if self.config.all_in_ev else self.hand.payoff(self.seat)
        return chips / self.bb - self.config.illegal_penalty * self.illegal

    def detail(self) -> dict[str, Any]:
        chips = self.hand.payoff(self.seat)
        ev = ({"all_in_ev_bb": self.hand.expected_payoff(self.seat) / self.bb}
              if self.config.all_in_ev and self.hand.all_in and not self.chips else {})  # costly: only when used
        if self.config.opponent_cards_ev and not self.chips:
            ev["opponent_cards_ev_bb"] = self.hand.opponent_cards_payoff(self.seat) / self.bb
        return {"chips": chips, "bb": chips / self.bb, **ev, "illegal": self.illegal, "replies": self.replies,
                "forced": self.forced, "opponent": self.opponent_name,
                "seat": "big blind" if self.seat == BIG_BLIND_SEAT else "small blind", "actions": self.actions}


class _Run:
    """An episode's token sequence as it is played."""

    def __init__(self, episode: _Episode, prompt: list[int]):
        self.episode, self.prompt = episode, prompt
        self.completion: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] | None = []
        self.policy_tokens = 0
        self.reply_ended = False

    def add(self, ids: list[int], logprobs: list[float] | None, *, policy: bool) -> None:
        self.completion += ids
        self.mask += [int(policy)] * len(ids)
        if policy:
            self.policy_tokens += len(ids)
        if self.logprobs is not None:
            self.logprobs = None if policy and logprobs is None else self.logprobs + (
                list(logprobs) if policy else [0.0] * len(ids))

    def finish(self) -> Episode:
        e = self.episode
        return Episode(prompt_token_ids=self.prompt, completion_token_ids=self.completion, completion_mask=self.mask,
                       behavior_logprobs=self.logprobs, reward=e.reward(), reward_detail=e.detail(),
                       finish_reason="length" if e.forced else "stop")
