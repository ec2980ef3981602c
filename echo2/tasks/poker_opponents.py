"""The poker task's opponents. Each is a deterministic function of the hand so far and the deal's key,
so the learner replays an episode's opponent exactly (``poker.py``).

- ``random``: a uniformly chosen kind of legal action (fold only when facing a bet; check/call;
  raise), a raise size uniform between the minimum and a pot-sized raise, drawn from
  ``random.Random(f"{key}:{operations so far}")``.
- ``call_station``: always checks or calls.
- ``equity``: hand strength against one random hand, estimated by Monte Carlo with a generator
  seeded by the cards (pokerkit's ``StandardHighHand`` ranks the hands): raise the minimum above
  ``raise_above``, check when free, call when the strength beats the pot odds, else fold. Estimates
  are cached by cards, so the G episodes of a group pay for each street once.
- ``checkpoint``: a frozen earlier policy (``from_pretrained`` folder) reads its own seat's
  observation as a one-message chat (no history) and answers greedily; a malformed or illegal
  answer plays the default action. Replies are cached by prompt. The learner loads the same folder
  and replays it; greedy decoding on other hardware can, rarely, pick another token at a near tie.
  So each reply carries its smallest gap between the two best logits, and a decision whose gap is
  under ``tie_margin`` is a near tie (``decide``): a replay that parts from the file after one makes
  the file ungradable (set aside, its actor not blamed) rather than forged (``poker.py``).
"""

from __future__ import annotations

import random
from typing import Any

from echo2.config import (
    CallStationOpponentConfig,
    CheckpointOpponentConfig,
    EquityOpponentConfig,
    OpponentConfig,
    RandomOpponentConfig,
)
from echo2.tasks.poker_game import Action, Hand, answer_prefix, hand_strength, parse_action


class Opponent:
    name: str

    def act(self, hand: Hand, seat: int, key: str) -> Action:
        raise NotImplementedError

    def decide(self, hand: Hand, seat: int, key: str) -> tuple[Action, bool]:
        """``act``, and whether the action was a near tie another machine may decide otherwise (never, for
        the scripted opponents: they are exact functions of the hand)."""
        return self.act(hand, seat, key), False


class RandomOpponent(Opponent):
    name = "random"

    def act(self, hand: Hand, seat: int, key: str) -> Action:
        hand.log[seat].clear()
        legal = hand.legal()
        rng = random.Random(f"{key}:{len(hand.state.operations)}")
        kinds = (["fold", "check_call"] if legal.can_fold else ["check_call"]) + (["raise"] if legal.min_raise else [])
        kind = rng.choice(kinds)
        if kind != "raise":
            return Action(kind)
        pot_sized = legal.min_raise + hand.state.total_pot_amount
        return Action("raise", rng.randint(legal.min_raise, max(legal.min_raise, min(legal.max_raise, pot_sized))))


class CallStation(Opponent):
    name = "call_station"

    def act(self, hand: Hand, seat: int, key: str) -> Action:
        hand.log[seat].clear()
        return Action("check_call")


class EquityPlayer(Opponent):
    name = "equity"

    def __init__(self, config: EquityOpponentConfig):
        self.raise_above = config.raise_above
        self.samples = config.samples

    def act(self, hand: Hand, seat: int, key: str) -> Action:
        hand.log[seat].clear()
        legal = hand.legal()
        board = "".join(map(repr, hand.state.get_board_cards(0)))
        strength = hand_strength(hand.deal.holes[seat], board, self.samples)
        if strength > self.raise_above and legal.min_raise is not None:
            return Action("raise", legal.min_raise)
        if not legal.to_call:
            return Action("check_call")
        pot_odds = legal.to_call / (hand.state.total_pot_amount + legal.to_call)
        return Action("check_call") if strength >= pot_odds else Action("fold")


class FrozenPolicy(Opponent):
    name = "checkpoint"

    def __init__(self, config: CheckpointOpponentConfig, *, system: str, answer_prefix: str, max_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(config.path)
        self.model = AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32, use_kernels=False).eval()
        self.system, self.answer_prefix, self.max_tokens = system, answer_prefix, max_tokens
        self.tie_margin = config.tie_margin
        self._replies: dict[tuple[str, str], tuple[str, float]] = {}

    def reply(self, text: str, prefix: str) -> tuple[str, float]:
        """The greedy reply to ``text`` after ``prefix`` (the answer prefix at this decision) and the smallest gap
        between its two best logits over the reply's tokens."""
        import torch

        if (text, prefix) not in self._replies:
            messages = [{"role": "system", "content": self.system}, {"role": "user", "content": text}]
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(prompt + prefix, add_special_tokens=False, return_tensors="pt").input_ids
            eos = self.tokenizer.eos_token_id
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=self.max_tokens, eos_token_id=eos,
                                          pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id
                                          is not None else eos, output_scores=True, return_dict_in_generate=True)
            best_two = torch.stack([step[0].topk(2).values for step in out.scores])
            gap = float((best_two[:, 0] - best_two[:, 1]).min())
            if len(self._replies) > 65536:
                self._replies.clear()
            self._replies[text, prefix] = (
                self.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True), gap)
        return self._replies[text, prefix]

    def decide(self, hand: Hand, seat: int, key: str) -> tuple[Action, bool]:
        text = f"{hand.opening(seat)}\n{hand.observation(seat)}"
        legal = hand.legal()
        reply, gap = self.reply(text, answer_prefix(self.answer_prefix, hand.told_strength, hand.strong_above))
        action, _ = parse_action(reply, legal)
        return action if action is not None else legal.default(), gap < self.tie_margin

    def act(self, hand: Hand, seat: int, key: str) -> Action:
        return self.decide(hand, seat, key)[0]


def make_opponent(config: OpponentConfig, *, system: str, answer_prefix: str, max_tokens: int) -> Opponent:
    if isinstance(config, RandomOpponentConfig):
        return RandomOpponent()
    if isinstance(config, CallStationOpponentConfig):
        return CallStation()
    if isinstance(config, EquityOpponentConfig):
        return EquityPlayer(config)
    if isinstance(config, CheckpointOpponentConfig):
        return FrozenPolicy(config, system=system, answer_prefix=answer_prefix, max_tokens=max_tokens)
    raise ValueError(f"unknown opponent {config!r}")


def opponent_names(configs: list[Any]) -> list[str]:
    """Names for reports: the kind, numbered when a kind appears twice (``equity``, ``equity-2``)."""
    names, seen = [], {}
    for c in configs:
        seen[c.kind] = seen.get(c.kind, 0) + 1
        names.append(c.kind if seen[c.kind] == 1 else f"{c.kind}-{seen[c.kind]}")
    return names
