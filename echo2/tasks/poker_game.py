"""One hand of heads-up No-Limit Texas Hold'em on pokerkit, dealt from a seed, told as text.

pokerkit owns the rules, the betting and the showdown; this module only deals, describes and
parses. Deals are deterministic: ``deal(key)`` draws 9 cards (seat 0's hole cards, seat 1's, the
board) with ``random.Random(key)``, and the cards are dealt explicitly (``deal_hole``, ``burn_card``,
``deal_board``), never from pokerkit's shuffled deck. Heads-up with blinds (SB, BB): seat 0 posts
the big blind, seat 1 the small blind and is the button (acts first before the flop, last after).

Amounts in answers and in the text are "raise to": the player's total bet on this street.

Answers (after the environment's answer prefix) are read by ``parse_action``: the reply must begin
with one of ``fold``, ``check``, ``call``, ``raise N`` / ``bet N`` / ``raise to N`` (N = the total bet;
no N = the minimum raise), or ``all in``; the rest of the reply is ignored. A reply that begins with
none of them is malformed; a fold when checking is free (unless ``Legal.fold_checks``), a check when
facing a bet, a call where calls are not offered (``Legal.can_call``), or a raise outside [min, max] is
illegal. Either way the hand goes on with the default action (check when free, else fold) and the caller
counts it. ``call`` with nothing to call checks.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import re
from dataclasses import dataclass, field

from pokerkit import Automation, Card, Deck, NoLimitTexasHoldem, StandardHighHand

_AUTOMATIONS = (Automation.ANTE_POSTING, Automation.BET_COLLECTION, Automation.BLIND_OR_STRADDLE_POSTING,
                Automation.HOLE_CARDS_SHOWING_OR_MUCKING, Automation.HAND_KILLING, Automation.CHIPS_PUSHING,
                Automation.CHIPS_PULLING)  # dealing and burning stay explicit: the deal is ours, seeded
_ACTION = re.compile(r"\s*(?:(fold)|(check)|(call)|(all[\s-]?in)|(?:raise|bet)(?:\s+to)?(?:\s+(\d{1,7}))?)(?![a-z])",
                     re.IGNORECASE)
_STREET_OF_BOARD = {0: "Flop", 3: "Turn", 4: "River"}
"""The street dealt next, by the number of board cards already out."""
BIG_BLIND_SEAT, SMALL_BLIND_SEAT = 0, 1
STRENGTH_SAMPLES = 200
"""Monte Carlo samples behind the observation's strength line (``show_strength``): +-3.5 points at 95%."""


@dataclass(frozen=True)
class Deal:
    holes: tuple[str, str]
    """Hole cards of seat 0 and seat 1, e.g. ('AsKs', '7c2d')."""
    board: str
    """The five board cards in dealing order, e.g. 'Ah7h2sKd3c'."""


def deal(key: str) -> Deal:
    cards = "".join(map(repr, random.Random(key).sample(list(Deck.STANDARD), 9)))
    return Deal(holes=(cards[0:4], cards[4:8]), board=cards[8:])


def spaced(cards: str) -> str:
    """'AsKs' -> 'As Ks'."""
    return " ".join(cards[i:i + 2] for i in range(0, len(cards), 2))


@dataclass(frozen=True)
class Action:
    kind: str
    """"fold", "check_call" or "raise"."""
    amount: int | None = None
    """Raise-to amount for "raise"."""


@dataclass(frozen=True)
class Legal:
    to_call: int
    can_fold: bool
    min_raise: int | None
    """Smallest legal raise-to (None: no raise possible)."""
    max_raise: int | None
    verb: str = "raise"
    """"bet" when nobody has bet on this street after the flop, else "raise" (the parser takes both)."""
    can_call: bool = True
    """Whether calling a bet is an option (``Hand.legal(flat_calls=False)``: only where it puts the player all in
    or matches an all in)."""
    fold_checks: bool = False
    """Whether ``fold`` with nothing to call checks instead of being illegal (``Hand.legal(flat_calls=False)``:
    in push-or-fold the passive action is one word in every spot, as ``call`` with nothing to call checks)."""

    def describe(self, shuffle: str | None = None) -> str:
        """The options, fold first; ``shuffle``: in the order a ``random.Random(shuffle)`` draws."""
        options = (["fold", "call"] if self.to_call and self.can_call else ["fold"] if self.to_call else ["check"])
        if self.min_raise is not None:
            options.append(f"{self.verb} {self.min_raise}" if self.min_raise == self.max_raise
                           else f"{self.verb} {self.min_raise}-{self.max_raise}")
        if shuffle is not None:
            random.Random(shuffle).shuffle(options)
        return ", ".join(options)

    def default(self) -> Action:
        """What a malformed or illegal answer plays: check when free, else fold."""
        return Action("fold") if self.to_call else Action("check_call")


def parse_action(reply: str, legal: Legal) -> tuple[Action | None, str]:
    """The action a reply names and whether it is legal: (action, "ok") or (None, "malformed"|"illegal")."""
    m = _ACTION.match(reply)
    if m is None:
        return None, "malformed"
    fold, check, call, all_in, amount = m.groups()
    if fold:
        if legal.can_fold:
            return Action("fold"), "ok"
        return (Action("check_call"), "ok") if legal.fold_checks and not legal.to_call else (None, "illegal")
    if check:
        return (Action("check_call"), "ok") if legal.to_call == 0 else (None, "illegal")
    if call:
        return (Action("check_call"), "ok") if legal.can_call or not legal.to_call else (None, "illegal")
    if all_in:
        return (Action("raise", legal.max_raise), "ok") if legal.max_raise is not None else (Action("check_call"), "ok")
    if legal.min_raise is None:
        return None, "illegal"
    value = legal.min_raise if amount is None else int(amount)
    if not legal.min_raise <= value <= legal.max_raise:
        return None, "illegal"
    return Action("raise", value), "ok"


def is_strong(percent: int, strong_above: int) -> bool:
    """Whether a told strength (percent) is ``strong`` under ``strong_above`` (that percent or more)."""
    return percent >= strong_above


def answer_prefix(template: str, told_strength: int | None, strong_above: int | None) -> str:
    """``template`` with ``{strength}`` replaced by the word of the strength line last told (``strong``/``weak``)."""
    if "{strength}" not in template:
        return template
    if told_strength is None or strong_above is None:
        raise ValueError("an answer prefix naming {strength} needs a told strength and strong_above")
    return template.replace("{strength}", "strong" if is_strong(told_strength, strong_above) else "weak")


@functools.lru_cache(maxsize=65536)
def hand_strength(hole: str, board: str, samples: int) -> float:
    """P(win) + P(tie)/2 of ``hole`` against one uniformly random hand, the board completed at random; seeded by
    the cards, so every machine computes the same figure."""
    hole_cards, board_cards = list(Card.parse(hole)), list(Card.parse(board))
    rest = [c for c in Deck.STANDARD if c not in hole_cards and c not in board_cards]
    rng = random.Random(f"strength:{hole}:{board}:{samples}")
    score = 0.0
    for _ in range(samples):
        drawn = rng.sample(rest, 2 + 5 - len(board_cards))
        score += _showdown(hole_cards, drawn[:2], board_cards + drawn[2:])
    return score / samples


def _showdown(mine: list, theirs: list, board: list) -> float:
    """1 when ``mine`` beats ``theirs`` on the five-card ``board``, 0.5 on a tie, else 0."""
    a, b = StandardHighHand.from_game(mine, board), StandardHighHand.from_game(theirs, board)
    return 1.0 if a > b else 0.5 if a == b else 0.0


EV_SAMPLES = 500
"""Monte Carlo samples behind ``Hand.opponent_cards_payoff`` (+-2.2 points of strength at 95%)."""
ALL_IN_SAMPLES = 500
"""Seeded runouts behind ``all_in_equity`` where there are more than this many (before the turn: +-2.2 points
at 95%); after the turn all 44 are counted."""


def all_in_equity(hole: str, other: str, board: str) -> float:
    """P(win) + P(tie)/2 of ``hole`` against ``other`` over the board's undealt cards: every runout where there
    are at most ``ALL_IN_SAMPLES``, else that many seeded by the cards (both sides' figures sum to 1), so every
    machine computes the same figure."""
    return _equity(hole, other, board) if hole <= other else 1.0 - _equity(other, hole, board)


@functools.lru_cache(maxsize=65536)
def _equity(hole: str, other: str, board: str) -> float:
    mine, theirs, known = list(Card.parse(hole)), list(Card.parse(other)), list(Card.parse(board))
    rest = [c for c in Deck.STANDARD if c not in mine and c not in theirs and c not in known]
    need = 5 - len(known)
    if math.comb(len(rest), need) <= ALL_IN_SAMPLES:
        runouts = [list(drawn) for drawn in itertools.combinations(rest, need)]
    else:
        rng = random.Random(f"all-in:{hole}:{other}:{board}")
        runouts = [rng.sample(rest, need) for _ in range(ALL_IN_SAMPLES)]
    return sum(_showdown(mine, theirs, known + drawn) for drawn in runouts) / len(runouts)


@dataclass
class Hand:
    """A hand in play. ``log[seat]`` collects what happened since that seat last decided, told to it."""

    deal: Deal
    starting_stack: int
    small_blind: int
    big_blind: int
    show_strength: bool = False
    """Tell the player to act its hand strength (``hand_strength``, in percent) beside its cards."""
    push_fold: bool = False
    """The player told observations (``observation``) may raise only all in: ``legal(push_fold=True)``."""
    strong_above: int | None = None
    """With ``show_strength``: the strength line also says ``strong`` at this percent or more, else ``weak``."""
    shuffle_legal: bool = False
    """The Legal line's options in an order drawn from the deal, the seat and the decision (seeded)."""
    flat_calls: bool = True
    """False: the player told observations may call only a bet that leaves it no raise (pure push-or-fold with
    ``push_fold``): ``legal(flat_calls=False)``."""
    state: object = field(init=False)
    log: tuple[list[str], list[str]] = field(init=False)
    told_strength: int | None = field(init=False, default=None)
    """The strength (percent) the last observation told, with ``show_strength``."""
    all_in: tuple[str, int] | None = field(init=False, default=None)
    """Where the chips went all in with cards still to come: (the board then, the chips each side had at stake)."""
    showdown: tuple[str, int] | None = field(init=False, default=None)
    """Where the hand ended in a showdown with the board complete: (the board, the chips each side had at stake)."""

    def __post_init__(self) -> None:
        self.state = NoLimitTexasHoldem.create_state(
            _AUTOMATIONS, True, 0, (self.small_blind, self.big_blind), self.big_blind, self.starting_stack, 2)
        self.state.deal_hole(self.deal.holes[0])
        self.state.deal_hole(self.deal.holes[1])
        self.log = ([], [])
        self._streets = iter((self.deal.board[:6], self.deal.board[6:8], self.deal.board[8:10]))
        self._advance()

    def _advance(self) -> None:
        """Deal the board as the betting allows, until someone must act or the hand is over."""
        s = self.state
        while s.status and s.actor_index is None:
            if s.can_burn_card():
                s.burn_card("??")
            elif s.can_deal_board():
                street = _STREET_OF_BOARD[len(list(s.get_board_cards(0)))]  # after the river, the index is gone
                cards = next(self._streets)
                s.deal_board(cards)
                line = f"{street}: {spaced(cards)}."
                for seat_log in self.log:
                    seat_log.append(line)
            else:  # nothing to deal and nobody to act: pokerkit is finishing the hand
                break

    @property
    def over(self) -> bool:
        return not self.state.status

    @property
    def to_act(self) -> int | None:
        return None if self.over else self.state.actor_index

    def legal(self, push_fold: bool = False, flat_calls: bool = True) -> Legal:
        """What the player to act may do; ``push_fold``: its only raise is all in (min = max = all in);
        ``flat_calls=False``: it may call only where it cannot raise (calling an all in, or a bet that takes
        its whole stack), so with ``push_fold`` its options are the passive one and all in, and ``fold`` is the
        passive one everywhere (with nothing to call it checks)."""
        s = self.state
        can_raise = s.can_complete_bet_or_raise_to()
        to_call = s.checking_or_calling_amount or 0
        least = s.min_completion_betting_or_raising_to_amount if can_raise else None
        most = s.max_completion_betting_or_raising_to_amount if can_raise else None
        return Legal(to_call=to_call, can_fold=s.can_fold(), min_raise=most if push_fold else least, max_raise=most,
                     verb="bet" if s.street_index and not any(s.bets) else "raise",
                     can_call=flat_calls or not can_raise, fold_checks=not flat_calls)

    def play(self, action: Action) -> None:
        """The player to act plays ``action`` (legal: parse_action checked it, or it is the default)."""
        seat, s = self.to_act, self.state
        to_call = s.checking_or_calling_amount or 0
        verb = self.legal().verb
        put_in = [self.starting_stack - stack for stack in s.stacks]  # chips each side has bet so far
        if action.kind == "check_call":
            put_in[seat] += to_call
        if action.kind == "fold":
            s.fold()
            said = "fold"
        elif action.kind == "check_call":
            s.check_or_call()
            said = f"call {to_call}" if to_call else "check"
        else:
            s.complete_bet_or_raise_to(action.amount)
            said = f"bet {action.amount}" if verb == "bet" else f"raise to {action.amount}"
        self.log[seat].append(f"You {said}.")
        self.log[1 - seat].append(f"Opponent {_third_person(said)}.")
        if s.status and s.actor_index is None and 0 in s.stacks and len(board := list(s.get_board_cards(0))) < 5:
            stakes = [self.starting_stack - stack for stack in s.stacks]  # nobody can bet again: the rest is dealt
            self.all_in = ("".join(map(repr, board)), min(stakes))
        self._advance()
        if not s.status and action.kind != "fold" and self.all_in is None:  # a call or check ended it: cards shown
            self.showdown = (self.deal.board, min(put_in))

    def observation(self, seat: int) -> str:
        """What ``seat`` is told when it must act: what happened since its last decision, then the state
        (kept short: every environment token is prefilled again at every later decision)."""
        s = self.state
        board = list(s.get_board_cards(0))
        lines = list(self.log[seat])
        self.log[seat].clear()
        legal = self.legal(self.push_fold, self.flat_calls)
        strength = ""
        if self.show_strength:
            value = hand_strength(self.deal.holes[seat], "".join(map(repr, board)), STRENGTH_SAMPLES)
            percent = self.told_strength = round(100 * value)
            word = ("" if self.strong_above is None
                    else ", strong" if is_strong(percent, self.strong_above) else ", weak")
            strength = f"Strength {percent}%{word}. "
        lines.append(f"Cards: {spaced(self.deal.holes[seat])}. Board: {' '.join(map(repr, board)) if board else '-'}. "
                     f"{strength}Pot {s.total_pot_amount}, to call {legal.to_call}. "
                     f"Stacks {s.stacks[seat]}/{s.stacks[1 - seat]}.")
        order = f"legal:{self.deal.holes}:{self.deal.board}:{seat}:{len(s.operations)}" if self.shuffle_legal else None
        lines.append(f"Legal: {legal.describe(order)}.")
        return "\n".join(lines)

    def opening(self, seat: int) -> str:
        """The first line a seat reads in a hand."""
        role = "small blind, first to act" if seat == SMALL_BLIND_SEAT else "big blind"
        return f"Blinds {self.small_blind}/{self.big_blind}, stacks {self.starting_stack}. You: {role}."

    def payoff(self, seat: int) -> int:
        return int(self.state.payoffs[seat])

    def expected_payoff(self, seat: int) -> float:
        """``payoff``, except that a hand that went all in with cards to come pays its expectation over the
        undealt cards (``all_in_equity``) instead of the runout dealt: the same mean, without the luck of the
        board after the last decision."""
        if self.all_in is None:
            return float(self.payoff(seat))
        board, stake = self.all_in
        return (2 * all_in_equity(self.deal.holes[seat], self.deal.holes[1 - seat], board) - 1) * stake

    def opponent_cards_payoff(self, seat: int) -> float:
        """``payoff`` averaged over the opponent's hole cards as well as the undealt board: a hand that ended in a
        showdown or an all in pays its chips at stake times (2 x its strength against one random hand on the
        board then - 1) (``hand_strength``, ``EV_SAMPLES``); a fold pays its chips. The same mean as ``payoff``
        where the opponent's play did not depend on its cards (a call-station, the random player), without the
        luck of which hand it held."""
        end = self.all_in or self.showdown
        if end is None:
            return float(self.payoff(seat))
        board, stake = end
        return (2 * hand_strength(self.deal.holes[seat], board, EV_SAMPLES) - 1) * stake


def _third_person(said: str) -> str:
    verb, _, rest = said.partition(" ")
    verb = {"fold": "folds", "check": "checks", "call": "calls", "raise": "raises", "bet": "bets"}[verb]
    return f"{verb} {rest}".strip()
