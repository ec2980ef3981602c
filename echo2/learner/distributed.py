"""The learner over N processes (``torchrun``) on one node or several: FSDP2 sharding, rank 0 drives, others follow.

Process layout. Rank 0 is the learner everything else talks to: it runs the ``echo2-train`` Prefect
flow, reads and validates rollouts, publishes versions, writes checkpoints and runs the fleet, exactly
as a one-process learner does. Its learner object is a ``DistributedLearner``, and every operation that
needs all ranks (a step, gathering the full weights, writing or restoring a checkpoint) is
first announced to ranks 1..N-1 by a broadcast of ``(op, payload)`` over the gloo control group
(``process_group.py``); they run ``follow()``: wait for an op, do their share, until ``stop``. NCCL carries FSDP's
collectives inside an op only, so a follower never waits in NCCL while rank 0 works alone (waits for rollouts,
validates them, writes to the store): it waits in gloo, whose timeout is a week. So the flow, the store, the
actors and the fleet see one learner;
only the arithmetic is spread. (The ranks are all the learner's own processes: the broadcast's pickle
never carries anything an actor wrote that validation has not already turned into plain tensors.)

Nodes. The N processes may span nodes (``echo2 learner --nnodes``, ``learner/torchrun.py``): N = nodes x
processes per node, and torchrun's static rendezvous makes node 0's first process rank 0. Nothing above
changes: the broadcasts and FSDP's collectives simply cross the network (NCCL between GPUs; gloo on CPUs),
and node 0 alone resolves the run, reaches the store and runs the flow. The launcher of another node never
reads the run or the store: its processes get the run's config from rank 0 over the group right after
``init_process_group`` (``share_config``), as ranks 1..P-1 of node 0 do. Whoever reaches the rendezvous
port could join the group, so it must be open between the learner's nodes only.

Models: every rank builds the model on the ``meta`` device and rank 0 alone reads the checkpoint, once, in the
file's dtype, and sends each tensor to the others, which keep their shards (``model_load.py``).

Sharding (``fsdp_units.py``): every decoder layer is its own FSDP2 unit (``fully_shard``), then the root unit:
the learner's
``PolicyLogprobs`` around the whole model, so tied embeddings stay in one unit and the chunked head
(``learner/logprobs.py``), which runs inside that wrapper's forward, sees its weight unsharded; parameters,
gradients and AdamW moments are split over the ranks, and parameter names stay ``self.model``'s. With
a bf16 compute dtype every unit has ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``:
fp32 shards (what AdamW updates and checkpoints hold), bf16 all-gathered copies in compute, fp32 gradient
reduce-scatter. Activation checkpointing (``train.activation_checkpointing``) is applied to each layer before
it is sharded (composable: hooks, no wrapper, so no name changes).

A step is learner.py's GRPO step over the same rows, with the packed micro-batches dealt out:
    rank 0 broadcasts the step's columns (``columns.step_columns``: offsets + values tensors)
    every rank computes the same advantages, signal filter and packs (deterministic; a pack holds at
        most micro_batch_tokens, and at most a rank's even share of the step's tokens)
    the packs are dealt by tokens: longest first, each to the rank with the fewest tokens so far (ties:
        the lowest rank); a rank with fewer packs than the most runs a zero-weight pass of the step's
        smallest pack for each missing one, since FSDP's all-gathers and reduce-scatters need every rank
    losses are normalized by the step's token count over all ranks and gradients are summed, not
        averaged (``set_gradient_divide_factor(1)``): the step's gradient is the one-process gradient,
        up to the order of float additions
    the global gradient norm is clipped (DTensor-aware ``clip_grad_norm_``), AdamW updates each shard
    the metrics' sums are all-reduced

Publishing gathers each tensor in turn on the devices, in the publish dtype, and only rank 0 copies it to host
memory (``Learner.gathered``): rank 0 holds the version once, in ``publish.dtype``, never an fp32 copy beside it.
A checkpoint gathers nothing: every rank writes and reads its own shards of the weights and of the AdamW state with
``torch.distributed.checkpoint`` (``checkpoint_files.py``, ``checkpoint.py``; DCP's planning over the control group),
keyed by parameter name, so a checkpoint of N ranks resumes on any number of ranks, one process included. Evaluation
generates with the sharded policy itself, on every rank at once (``generate``: rank 0 announces each call, every
rank runs it with ``synced_gpus``, so their forwards and FSDP's gathers stay in step; no rank holds a copy), and the
spot check recomputes a file's log-probabilities with a sharded frozen copy, its packs dealt like a step's.
LoRA runs in one process only (config refuses ``nproc > 1`` with ``lora_rank > 0``).

Stopping (SIGTERM, Ctrl-C). torchrun passes the signal to every rank. Only rank 0 acts on it, as the
one-process learner does (a final checkpoint, then ``stop``): the followers ignore SIGINT and SIGTERM, since
that checkpoint needs them, and end on ``stop`` or when the group breaks (rank 0 gone: their next collective
fails on gloo; NCCL may not notice, and torchrun's SIGKILL after its grace ends them). A signal that reaches rank 0
while an announced op is in flight is acted on once the op has ended
(``stop_signals_deferred``): raised in the middle, rank 0 would leave the followers inside the op's
collectives and announce the checkpoint to ranks still waiting there. A step is the exception: at each of its safe
points (between packs, before the optimizer step; ``notice.py``) every rank all-reduces whether rank 0 holds a
deferred signal, and if so rank 0 hands it to its handler there; when the handler abandons the step (a notice that
the step cannot finish within, Ctrl-C) every rank leaves the step at that same point, before any weight changed,
the followers back to ``follow()`` and rank 0 with the handler's exception. torchrun's ``--shutdown-timeout``
(``torchrun.STOP_GRACE_S``) bounds the whole: after it, torchrun SIGKILLs whatever is left.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import torch

from echo2.config import Config, LearnerConfig, TrainConfig
from echo2.devices import resolve_device
from echo2.learner.columns import step_columns
from echo2.learner.learner import Learner
from echo2.learner.notice import STOP_SIGNALS, deferred_pending, deliver_deferred, signals_deferred
from echo2.learner.packing import StepColumns, pack_rows, pack_tokens
from echo2.learner.process_group import backend_for, control_group, leave, world
from echo2.learner.process_group import init_process_group as join_group

log = logging.getLogger("echo2.learner")

__all__ = ["DistributedLearner", "deal_by_tokens", "init_process_group", "learner_options", "make_learner",
           "release_followers",
           "share_config", "start_process", "stop_signals_deferred", "world"]


def init_process_group(config: LearnerConfig) -> tuple[int, int]:
    """Join the group ``torchrun`` set up (RANK, WORLD_SIZE, MASTER_ADDR in the environment; RANK counts over
    every node, LOCAL_RANK within this one picks the GPU), on ``learner.device`` with ``learner.dist_backend``
    (``process_group.py``: NCCL for FSDP on GPUs, a gloo control group beside it)."""
    device = resolve_device(config.device)
    return join_group(device, backend_for(device, config.dist_backend))


def share_config(config: dict | None) -> dict:
    """Rank 0's resolved config (``Config.model_dump``) to every rank, once, right after ``init_process_group``
    and before anything else is broadcast: the run other nodes' processes take part in, which only node 0's
    launcher resolved. Every rank calls it; only rank 0's ``config`` is read."""
    import torch.distributed as dist

    message = [config if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(message, src=0, group=control_group())
    return message[0]


def start_process(start_file: Path, on_follow=lambda: None) -> Config | None:
    """A process of ``echo2 learner`` under torchrun, from the start file its node's launcher wrote
    (``learner/torchrun.py``): join the group, take the run's config from rank 0, and on every rank but 0
    follow until rank 0 says stop (returns None). Rank 0 gets its config back, to run the flow with."""
    from echo2.config import config_from_dict
    from echo2.learner.torchrun import joined
    from echo2.models import resolve_model

    start = config_from_dict(json.loads(start_file.read_text()), str(start_file))
    rank, _ = init_process_group(start.learner)
    from echo2.learner.torchrun import for_followers

    shared = share_config(for_followers(start.model_dump(mode="json")) if rank == 0 else None)
    joined(start_file)
    if rank == 0:
        return start
    for signum in STOP_SIGNALS:  # rank 0 stops this follower (``stop``), after its final checkpoint
        signal.signal(signum, signal.SIG_IGN)
    config = config_from_dict(shared, "rank 0 of the learner")
    on_follow()
    model_dir = resolve_model(config.model.name, revision=config.model.revision)  # rank 0's: the run's commit
    DistributedLearner(model_dir, config.train, temperature=config.rollout.temperature,
                       **learner_options(config)).follow()
    leave()
    return None


def learner_options(config: Config) -> dict:
    """What a ``Learner`` reads from outside the run's ``train`` section: ``learner.device``, ``publish.dtype`` and
    ``publish.shard_mb``."""
    return {"device": config.learner.device, "publish_dtype": config.publish.dtype,
            "shard_mb": config.publish.shard_mb}


def make_learner(model_dir: Path, config: TrainConfig, *, temperature: float, **options) -> Learner:
    """The one-process learner, or rank 0's ``DistributedLearner`` inside a torchrun group; ``options``: the
    ``Learner``'s keywords (``learner_options``)."""
    if world()[1] > 1:
        return DistributedLearner(model_dir, config, temperature=temperature, **options)
    return Learner(model_dir, config, temperature=temperature, **options)


class DistributedLearner(Learner):
    def __init__(self, model_dir: Path, config: TrainConfig, *, temperature: float, **options):
        super().__init__(model_dir, config, temperature=temperature, sharded=True, **options)
        self._spot_check_weights: dict | None = None
        """Rank 0, while a spot check op runs: the version its copy loads (never sent with the announcement)."""

    # -- rank 0's side: announce, then take part ------------------------------------------------
    def _announce(self, op: str, payload=None):
        import torch.distributed as dist

        with stop_signals_deferred():  # the followers run the op's collectives to the end: so does rank 0
            if self.rank == 0:
                dist.broadcast_object_list([op, payload], src=0, group=control_group())
            return getattr(self, f"_op_{op}")(payload)

    def train_step(self, tables) -> dict:
        return self._announce("step", step_columns(tables))

    def gathered(self, names: list[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return self._announce("gathered", (names, dtype))

    def save_sharded(self, store, prefix: str) -> list[dict]:
        return self._announce("save_sharded", (store, prefix))

    def load_sharded(self, store, prefix: str, entries: dict[str, dict]) -> None:
        self._announce("load_sharded", (store, prefix, entries))

    def generate(self, kwargs: dict) -> torch.Tensor:
        return self._announce("generate", {k: v.cpu() if isinstance(v, torch.Tensor) else v
                                           for k, v in kwargs.items()})

    def behavior_gap(self, version: int, weights: dict[str, torch.Tensor], columns: StepColumns,
                     micro_batch_tokens: int) -> tuple[float, int]:
        # the weights stay on rank 0: the spot check's copy takes them from there only when its version changes, once
        # rank 0 has checked them (a refusal inside the op would leave the followers in its broadcast)
        changing = self._spot_check_version != version
        if changing:
            self.check_weights(weights)
        self._spot_check_weights = weights  # rank 0's alone: the announcement carries none
        try:
            return self._announce("gap", (version, changing, columns, micro_batch_tokens))
        finally:
            self._spot_check_weights = None

    def release(self) -> None:
        """Let the followers go (rank 0, once the run is over)."""
        if self.rank == 0:
            release_followers()

    # -- every rank --------------------------------------------------------------------------
    def follow(self) -> None:
        """Ranks 1..N-1: do what rank 0 announces until it says stop."""
        import torch.distributed as dist

        while True:
            message = [None, None]
            dist.broadcast_object_list(message, src=0, group=control_group())
            op, payload = message
            if op == "stop":
                return
            getattr(self, f"_op_{op}")(payload)

    def _op_step(self, columns: StepColumns) -> dict | None:
        try:
            return self.step_on_columns(columns)
        except _StepAbandoned:  # a follower: rank 0's handler abandoned the step at a safe point (gradients dropped)
            return None

    def _safe_point(self) -> None:
        """Every rank at once: whether rank 0 holds a deferred signal (all-reduced over the control group), and if it
        does, whether its handler abandoned the step; an abandoned step ends on every rank here."""
        pending = torch.tensor([1.0 if self.rank == 0 and deferred_pending() else 0.0], dtype=torch.float64)
        if not self._sum_over_ranks(pending)[0]:
            return
        abandoned: BaseException | None = None
        if self.rank == 0:
            try:
                deliver_deferred()
            except BaseException as exc:  # NoticeInterrupt, KeyboardInterrupt: raised once every rank knows
                abandoned = exc
        verdict = torch.tensor([0.0 if abandoned is None else 1.0], dtype=torch.float64)
        if not self._sum_over_ranks(verdict)[0]:
            return  # the handler let the step finish
        raise abandoned if abandoned is not None else _StepAbandoned()

    def _op_gathered(self, payload) -> dict[str, torch.Tensor]:
        """Every rank gathers each tensor on its device in turn; only rank 0 keeps the host copies."""
        whole = Learner.gathered(self, *payload)
        return whole if self.rank == 0 else {}

    def _op_generate(self, kwargs: dict) -> torch.Tensor:
        return Learner.generate(self, kwargs)

    def _op_gap(self, payload) -> tuple[float, int]:
        """The spot check's arithmetic for one file: its packs dealt over the ranks like a step's (no backward)."""
        version, changing, columns, micro_batch_tokens = payload
        if changing:  # every rank loads the new version: rank 0 sends each tensor, the others keep their shards
            self._spot_check_version = None
        policy = self._spot_check_copy(version, self._spot_check_weights if self.rank == 0 else {})
        packs = pack_rows(columns, range(columns.num_rows), lambda _: micro_batch_tokens,
                          share_prompts=self.shares_prompts)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        no_advantages = torch.zeros(columns.num_rows)
        mine, fillers = self._my_packs(columns, packs)
        for pack in mine:
            total += self._gap_of(policy, self._pack(columns, pack, no_advantages))
        for pack in fillers:  # FSDP's collectives need every rank: a pass whose result is not counted
            self._gap_of(policy, self._pack(columns, pack, no_advantages))
        return self._sum_over_ranks(total.cpu())


    def _op_save_sharded(self, payload) -> list[dict]:
        """Every rank writes its shards (DCP; rank 0 its metadata last); rank 0 gets every rank's file entries."""
        import torch.distributed as dist

        store, prefix = payload
        mine = Learner.save_sharded(self, store, prefix)
        every: list = [None] * self.world_size
        dist.all_gather_object(every, mine, group=control_group())
        return [entry for entries in every for entry in entries]

    def _op_load_sharded(self, payload) -> None:
        """Every rank reads its shards; a refused file on any rank fails the load on all of them (DCP), and
        a follower then waits for the next op (rank 0 tries an older checkpoint)."""
        from echo2.learner.checkpoint import UNLOADABLE

        try:
            Learner.load_sharded(self, *payload)
        except UNLOADABLE as exc:
            if self.rank == 0:
                raise
            log.info("rank %d: checkpoint %s not loaded: %s", self.rank, payload[1], exc)

    def _pack_budget(self, step_tokens: int) -> int:
        """``micro_batch_tokens``, or less when the step is small: at most a rank's even share of the step's
        tokens, so that every rank gets a pack to train (one pack of a small step would leave the others
        running only zero-weight fillers)."""
        return max(1, min(self.config.micro_batch_tokens, -(-step_tokens // self.world_size)))

    def _my_packs(self, columns: StepColumns, packs: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
        """This rank's packs (``deal_by_tokens``), and the filler passes it runs to match the rank with the most
        (each the step's smallest pack, at zero weight)."""
        tokens = [pack_tokens(columns, pack, share_prompts=self.shares_prompts) for pack in packs]
        dealt = deal_by_tokens(tokens, self.world_size)
        smallest = packs[min(range(len(packs)), key=lambda j: (tokens[j], j))]
        return [packs[j] for j in dealt[self.rank]], [smallest] * (max(map(len, dealt)) - len(dealt[self.rank]))

    def _accumulate(self, columns, packs, advantages, n_tokens) -> torch.Tensor:
        """This rank's packs, then zero-weight passes up to the most packs any rank runs; this rank's sums."""
        sums = torch.zeros(4, dtype=torch.float32, device=self.device)
        mine, fillers = self._my_packs(columns, packs)
        for pack in mine:
            self._safe_point()
            self._backward(self._pack(columns, pack, advantages), n_tokens, sums)
        for pack in fillers:  # FSDP's collectives need every rank
            self._safe_point()
            terms = self._micro_batch(self._pack(columns, pack, advantages), n_tokens)
            (terms.loss * 0.0).backward()
        return sums

    def _read_totals(self, sums: torch.Tensor, grad_norm: torch.Tensor) -> tuple[dict, float]:
        """Every rank reports the step's totals, not its share: the sums added over the control group."""
        totals, norm = Learner._read_totals(self, sums, grad_norm)
        keys = list(totals)
        summed = self._sum_over_ranks(torch.tensor([totals[k] for k in keys], dtype=torch.float64))
        return dict(zip(keys, summed)), norm

    def _sum_over_ranks(self, values: torch.Tensor) -> list:
        import torch.distributed as dist

        dist.all_reduce(values, group=control_group())
        return values.tolist()


def deal_by_tokens(tokens: list[int], ranks: int) -> list[list[int]]:
    """Pack indices per rank: longest pack first, each to the rank holding the fewest tokens so far (ties:
    the lowest rank). Deterministic, so every rank computes the same deal."""
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for j in sorted(range(len(tokens)), key=lambda j: (-tokens[j], j)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        dealt[rank].append(j)
        load[rank] += tokens[j]
    return dealt


class _StepAbandoned(Exception):
    """A follower's step ended at a safe point because rank 0's handler abandoned it."""


def stop_signals_deferred():
    """SIGINT and SIGTERM received inside the block reach the handlers in place once it has ended (or at a step's
    safe point): ``notice.signals_deferred``, whose open blocks a step's safe points see."""
    return signals_deferred()


_released = False


def release_followers() -> None:
    """Rank 0: tell every follower to stop (once; also where no learner was ever built)."""
    global _released
    import torch.distributed as dist

    if _released or not dist.is_initialized() or dist.get_rank() != 0 or dist.get_world_size() == 1:
        return
    dist.broadcast_object_list(["stop", None], src=0, group=control_group())
    _released = True
