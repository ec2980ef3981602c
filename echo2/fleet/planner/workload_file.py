"""The workload file: what a user brings to ``echo2 plan --workload NAME|FILE`` (``infra/workloads/*.yaml``).

One YAML file describes a whole RL post-training run as the planner needs it: the model (total and active
parameters, or an HF-style ``config.json`` to count them from), how much data (prompts x epochs, or steps),
the rollout shape (G, groups per step and per actor batch, mean and p95 completion tokens, prompt tokens),
the training knobs (staleness S, kappa = ``publish.every`` as echo2's config calls it, the spot check
share, the checkpoint interval), the learner (GPU, count, market, MFU, and for a spot learner its reclaim rate,
relaunch and resume times and notice: ``spot_learner.py``), the actors (market, GPUs), the links and where the store
lives. ``echo2 plan``'s flags (``--model-params`` ...) build the same object (``from_flags``), so there is
one path from input to plan.

The uncertain inputs (``UNCERTAIN``) may carry a low and a high under ``ranges:`` (their likely value is the field's
own), each with its source: ``echo2 plan`` draws them (``run_range.py``) and answers with P10/P50/P90.

Every field has a default, and each default is an assumption: ``assumptions()`` lists every field with
its value and its source (the file's ``sources:`` entry for it, else "default: <what the field means>"),
and ``echo2 plan`` prints that list under its table. The field docstrings below and
``infra/workloads/README.md`` say what each field means; change any one and re-plan to see what moves.

Parameters are counted from a config by ``echo2.models.params_from_config``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from echo2 import shipped
from echo2.errors import Echo2InputError
from echo2.fleet.prices.catalog import read_yaml
from echo2.models import params_from_config

WORKLOADS = shipped.path("workloads")


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ModelSpec(_Part):
    name: str = "model"
    """A label for tables."""
    total_params_b: float | None = Field(None, gt=0)
    """Total parameters, billions: memory (does one replica fit a GPU), bytes of a keyframe."""
    active_params_b: float | None = Field(None, gt=0)
    """Parameters active per token, billions (a mixture of experts); None: dense, all of them."""
    config: str | None = None
    """An HF-style config.json to count total and active parameters from (relative to the workload file);
    the two fields above win where given."""


class DataSpec(_Part):
    prompts: int | None = Field(None, ge=1)
    """Prompts in the training set (one group of G completions each per epoch)."""
    epochs: float = Field(1.0, gt=0)
    """Passes over the prompts."""


class RolloutSpec(_Part):
    group_size: int = Field(8, ge=1)
    """G: completions per prompt."""
    groups_per_batch: int = Field(8, ge=1)
    """b: groups per actor batch, one rollout file (rollout.groups_per_batch)."""
    completion_tokens_mean: float = Field(512.0, gt=0)
    """Mean output tokens per completion: sets the tokens an actor makes and the learner trains on."""
    completion_tokens_p95: float | None = Field(None, gt=0)
    """95th percentile of output tokens: a batch ends with its longest completions, decoded one stream
    each at ``single_stream_tokens_per_second``; None: no tail term."""
    single_stream_tokens_per_second: float = Field(100.0, gt=0)
    """Decode speed of one sequence alone (the tail of a batch): bounded by one forward per token."""
    prompt_tokens: float = Field(200.0, ge=0)
    """Mean prompt tokens per completion (trained on in the forward pass, not generated)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """The completion cap (rollout.max_new_tokens): the longest a completion runs, so the longest a batch lasts;
    None: ``completion_tokens_p95`` stands in for it, and without either every completion is the mean's length."""
    max_pending_batches: int | None = Field(None, ge=1)
    """Q: flow control (rollout.max_pending_batches); None: ceil(R / b)."""
    at_cap_share: float | None = Field(None, ge=0, lt=1)
    """Share of completions that run to the cap (the rest: a gamma of shape 2 under it, decode.py); None: 5% when
    only a p95 is given, else 0."""
    refill: bool = False
    """The actor starts a new prompt group as each group finishes (rollout.refill) instead of generating one whole
    batch, then the next (decode.py: a slot still waits for its group's longest completion)."""
    decode_speed_factor: float = Field(1.0, gt=0)
    """The real engine's decode speed over the roofline model's (decode.py); 1: the calibrated model as it is."""


class TrainSpec(_Part):
    max_steps: int | None = Field(None, ge=1)
    """Learner steps of the run (train.max_steps); wins over data.prompts x data.epochs / groups_per_step.
    Neither: no run totals."""
    groups_per_step: int = Field(64, ge=1)
    """R: groups per learner step (train.groups_per_step)."""
    staleness: int = Field(2, ge=0)
    """S: a rollout of version v is used at learner version t only if t - v <= S (train.staleness)."""
    train_seconds: float | None = Field(None, gt=0)
    """T: learner busy seconds per step; given, it wins over the FLOP model (step_time.py)."""
    checkpoint_every: int = Field(5, ge=1)
    """Steps between the learner's periodic checkpoints (train.checkpoint_every): a spot learner reclaimed without
    a notice loses the steps since the last one (spot_learner.py); each checkpoint stops the learner while its
    fp32 weights and AdamW moments (12 bytes per parameter) are written (run_costs.py)."""
    signal_share: float = Field(1.0, gt=0, le=1)
    """Share of groups with a reward signal (not every completion scored alike): echo2 drops the others before the
    forward pass, so the learner trains on this share of the tokens (the spot check still reads every file's)."""


class PublishSpec(_Part):
    every: int = Field(1, ge=1)
    """kappa: publish a policy version every this many steps (publish.every)."""
    keyframe_every: int = Field(16, ge=1)
    """K: a whole version every K published versions, sparse deltas between (publish.keyframe_every; 1: no
    deltas)."""


class TrustSpec(_Part):
    spot_check_fraction: float = Field(0.1, ge=0, le=1)
    """Share of rollout files whose logprobs the learner recomputes (trust.spot_check_fraction): costs a
    forward pass (2 x active x tokens) on that share."""


class LearnerSpec(_Part):
    gpu: str = "H100"
    """The learner's GPU (a catalog GPU name; its bf16 peak from step_time.PEAK_BF16_TFLOPS)."""
    gpus: int | None = Field(None, ge=1)
    """GPUs of the learner, on one instance (the cheapest catalog offer with at least this many is billed
    whole); None: the fewest of 1, 2, 4, 8 whose memory holds the training state (run_plan.py)."""
    market: Literal["on-demand", "spot"] = "on-demand"
    """The learner's market."""
    provider: str | None = None
    """Only this provider's offers for the learner; None: any."""
    region: str | None = None
    """Only this region's offers for the learner; None: any."""
    mfu: float | None = Field(None, gt=0, le=1)
    """Model FLOPs utilization of the learner step; None: step_time.DEFAULT_MFU (25%) for a dense model, MOE_MFU
    (15%) for a mixture of experts (or --mfu-from)."""
    reclaims_per_hour: float | None = Field(None, ge=0)
    """Reclaims per hour of a spot learner's machine; None: providers.py's spot rate for the spot offer's provider
    (the rate the actors are planned with)."""
    recovery_minutes: float = Field(10.0, ge=0)
    """A reclaimed spot learner to its relaunched process starting: the managed job's recovery provisioning
    another instance, its setup, the process start (the checkpoint's read is ``resume_seconds``)."""
    resume_seconds: float | None = Field(None, ge=0)
    """The relaunched learner's restore before its first step; None: the training state read by its ranks in
    parallel, each at network.store_gbit (spot_learner.py)."""
    notice_probability: float | None = Field(None, ge=0, le=1)
    """Share of the learner's reclaims that come with a notice it hears; None: spot_learner.NOTICE's figure for
    the spot offer's provider (aws, gcp 0.95; others 0)."""
    notice_seconds: float | None = Field(None, ge=0)
    """Seconds a notice gives before the machine goes (the notice checkpoint must be written within them);
    None: spot_learner.NOTICE's (aws 120, gcp 30)."""


class ActorSpec(_Part):
    market: Literal["spot", "on-demand", "both"] = "spot"
    """Market(s) the actors are bought in."""
    gpus: list[str] | None = None
    """Only these actor GPUs (catalog names); None: any profiled GPU the model fits."""
    target_utilization: float = Field(0.95, gt=0, le=1)
    """Share of time the learner must train: the fleet is sized for it."""
    reclaim_per_hour: float | None = Field(None, ge=0)
    """Spot reclaims per instance-hour for every offer; None: providers.py's table per provider."""
    replacement_seconds: float = Field(600.0, ge=0)
    """Reclaim to a replacement producing (boot, model load, first weights)."""
    caps: dict[str, int] | None = None
    """Instances per (offer, market) at most, by key (``*``, a provider, an offer name); None: providers.py's."""
    reclaim_factor: float = Field(1.0, ge=0)
    """Multiplies every offer's independent reclaim rate (``reclaim_per_hour`` or providers.py's): the range's
    handle on how wrong the table may be."""
    burst_per_hour: float | None = Field(None, ge=0)
    """Correlated reclaims: bursts per hour that take ``burst_share`` of a provider's actors at once; None:
    providers.py's figure for each provider."""
    burst_share: float | None = Field(None, ge=0, le=1)
    """Share of a provider's actors one burst reclaims; None: providers.py's."""
    spot_price_factor: float = Field(1.0, gt=0)
    """The actors' price over the catalog snapshot's (spot prices move)."""


class NetworkSpec(_Part):
    store_gbit: float = Field(10.0, gt=0)
    """Gbit/s from the store to one reader (a relay root or an actor without the relay)."""
    peer_uplink_gbit: float = Field(1.0, gt=0)
    """Gbit/s an actor sends to its relay children."""
    fanout: int = Field(1, ge=1)
    """Children per relay node (broadcast.fanout)."""
    changed_fraction: float | None = Field(None, gt=0, le=1)
    """Share of parameters a delta carries; None: dissemination.DEFAULT_CHANGED_FRACTION (measured here)."""
    relay: bool = True
    """Peers pass versions on (one store read per provider and region) rather than every actor reading it."""
    dissemination_seconds: float | None = Field(None, ge=0)
    """D: given, it wins over the dissemination model."""
    upload_seconds: float = Field(1.0, ge=0)
    """U: a batch's upload until the learner sees it."""


class StoreSpec(_Part):
    provider: str | None = None
    """Provider of the store (object storage); None: the learner's."""
    region: str | None = None
    """Region of the store; None: the learner's."""


class Reference(_Part):
    name: str
    """The row's label."""
    usd: float = Field(gt=0)
    """Its cost of the whole run."""
    hours: float = Field(gt=0)
    """Its wall-clock hours."""
    source: str
    """Where the figures come from."""


class InputRange(_Part):
    """An uncertain input's low and high; its likely value is the field's own (so the plan at the likely values is
    the plan of the file as written)."""

    low: float
    """The lowest plausible value."""
    high: float
    """The highest plausible value."""
    source: str = ""
    """Where the range comes from."""

    @model_validator(mode="after")
    def _ordered(self):
        if self.low > self.high:
            raise ValueError(f"needs low <= high (got {self.low}, {self.high})")
        return self


RENAMED = {"rollout.groups_per_step": "train.groups_per_step",
           "train.max_pending_batches": "rollout.max_pending_batches",
           "data.steps": "train.max_steps", "network.keyframe_every": "publish.keyframe_every",
           "train.keyframe_every": "publish.keyframe_every", "train.publish_every": "publish.every",
           "train.audit_fraction": "trust.spot_check_fraction"}
"""Workload fields renamed to the run config's name and section for the same thing (old: new)."""

UNCERTAIN = ("learner.mfu", "train.signal_share", "rollout.completion_tokens_mean", "rollout.at_cap_share",
             "rollout.single_stream_tokens_per_second", "rollout.decode_speed_factor", "network.changed_fraction",
             "network.store_gbit", "actors.reclaim_factor", "actors.burst_per_hour", "actors.burst_share",
             "actors.replacement_seconds", "actors.spot_price_factor")
"""The inputs ``echo2 plan`` draws (``ranges:``): each is a workload field."""


class WorkloadFile(_Part):
    """One run to plan (see the module docstring)."""

    name: str = "workload"
    """A label."""
    description: str = ""
    """What the run is."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    publish: PublishSpec = Field(default_factory=PublishSpec)
    trust: TrustSpec = Field(default_factory=TrustSpec)
    learner: LearnerSpec = Field(default_factory=LearnerSpec)
    actors: ActorSpec = Field(default_factory=ActorSpec)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    store: StoreSpec = Field(default_factory=StoreSpec)
    compare: list[Reference] = Field(default_factory=list)
    """Other systems' cost and hours for the same work, shown beside echo2's."""
    sources: dict[str, str] = Field(default_factory=dict)
    """Where each value comes from, by dotted field name (``rollout.group_size``): shown with the assumptions."""
    ranges: dict[str, InputRange] = Field(default_factory=dict)
    """Low and high of an uncertain input (its likely value: the field's), by dotted field name (``UNCERTAIN``):
    ``echo2 plan`` draws them; an input without one gets run_range.DEFAULT_SPREAD."""
    base_dir: str | None = Field(None, exclude=True)
    """The folder of the file (model.config is relative to it); not a YAML field."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if not isinstance(data, dict):
            return data
        for old, new in RENAMED.items():
            section, _, field = old.partition(".")
            part = data.get(section)
            if (isinstance(part, dict) and field in part) or any(
                    isinstance(data.get(named), dict) and old in data[named] for named in ("sources", "ranges")):
                raise ValueError(f"{old} is now {new}, the run config's name for it: move it there")
        return data

    @model_validator(mode="after")
    def _checks(self):
        if self.train.staleness < self.publish.every - 1:
            raise ValueError(f"train.staleness {self.train.staleness} < publish.every - 1: the version it "
                             "needs is never published")
        p95 = self.rollout.completion_tokens_p95
        if p95 is not None and p95 < self.rollout.completion_tokens_mean:
            raise ValueError("rollout.completion_tokens_p95 must be >= completion_tokens_mean")
        cap = self.rollout.max_new_tokens
        if cap is not None and cap < self.rollout.completion_tokens_mean:
            raise ValueError("rollout.max_new_tokens must be >= completion_tokens_mean")
        return self

    # -- derived values ------------------------------------------------------------------------------
    def params_b(self) -> tuple[float, float | None]:
        """(total, active or None) billions: the fields, else counted from ``model.config``."""
        total, active = self.model.total_params_b, self.model.active_params_b
        if total is None and self.model.config:
            counted_total, counted_active = params_from_config(self.config_path())
            total = counted_total
            active = active if active is not None else (counted_active if counted_active < counted_total else None)
        if total is None:
            raise Echo2InputError(f"workload {self.name}: give model.total_params_b or model.config")
        if active is not None and active > total:
            raise Echo2InputError(f"workload {self.name}: model.active_params_b {active:g} > total {total:g}")
        return total, active

    def config_path(self) -> Path | None:
        """``model.config`` on disk: relative to the workload file; where that is not a file (a shipped workload in an
        installed wheel, whose ``../../echo2/bench/...`` leads nowhere), the file of that name among echo2's shipped
        model configs (``echo2/bench/learner_configs``)."""
        if not self.model.config:
            return None
        path = Path(self.model.config)
        if not path.is_absolute() and self.base_dir:
            path = Path(self.base_dir) / path
        if not path.is_file():
            shipped_config = Path(str(files("echo2.bench.learner_configs").joinpath(path.name)))
            if shipped_config.is_file():
                return shipped_config
        return path

    def steps(self) -> int | None:
        """Learner steps of the run (train.max_steps, else ceil(prompts x epochs / R)); None when unknown."""
        if self.train.max_steps is not None:
            return self.train.max_steps
        if self.data.prompts is None:
            return None
        return max(1, -(-round(self.data.prompts * self.data.epochs) // self.train.groups_per_step))

    def length_cap(self) -> tuple[float | None, float]:
        """(cap, share at the cap) of the completion lengths (``rollout.max_new_tokens`` / ``at_cap_share``)."""
        r = self.rollout
        cap = r.max_new_tokens if r.max_new_tokens is not None else r.completion_tokens_p95
        share = r.at_cap_share if r.at_cap_share is not None else (0.05 if r.max_new_tokens is None and cap else 0.0)
        return (float(cap) if cap is not None else None), share

    def completion_tokens_per_step(self) -> float:
        r = self.rollout
        return self.train.groups_per_step * r.group_size * r.completion_tokens_mean

    def tokens_per_step(self) -> float:
        """Tokens the learner trains on per step: prompt plus completion of every completion."""
        r = self.rollout
        return self.train.groups_per_step * r.group_size * (r.completion_tokens_mean + r.prompt_tokens)

    def assumptions(self) -> list[dict]:
        """Every field as {name, value, source}: the file's ``sources`` entry, else where the value came from."""
        given = self.model_fields_set
        out = []
        for section in ("model", "data", "rollout", "train", "publish", "trust", "learner", "actors", "network",
                        "store"):
            part = getattr(self, section)
            for field, info in type(part).model_fields.items():
                key = f"{section}.{field}"
                value = getattr(part, field)
                if key in self.sources:
                    source = self.sources[key]
                elif section in given and field in part.model_fields_set:
                    source = "given, no source stated"
                else:
                    source = "default: an assumption (infra/workloads/README.md says what the field means)"
                out.append({"name": key, "value": value, "source": source})
        return out


def load_workload(name_or_path: str | Path) -> WorkloadFile:
    """A workload from a YAML file, or by NAME from the shipped ``infra/workloads/NAME.yaml``."""
    text = str(name_or_path)
    path = Path(text)
    if not path.is_file() and "/" not in text and not text.endswith((".yaml", ".yml")):
        shipped_path = WORKLOADS / f"{text}.yaml"
        if not shipped_path.is_file():
            names = sorted(p.stem for p in WORKLOADS.glob("*.yaml")) if WORKLOADS.is_dir() else []
            raise Echo2InputError(f"no workload {text!r}: give a YAML file or one of {', '.join(names) or 'none'}")
        path = shipped_path
    data = read_yaml(path, "workload")
    if not isinstance(data, dict):
        raise Echo2InputError(f"workload {path}: must be a mapping of sections (model:, data:, rollout: ...)")
    return parse_workload(data, where=str(path), base_dir=str(path.parent))


def parse_workload(data: dict, *, where: str = "workload", base_dir: str | None = None) -> WorkloadFile:
    """A validated workload from a mapping; one Echo2InputError line naming the bad field."""
    try:
        workload = WorkloadFile.model_validate({**data, "base_dir": base_dir})
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        raise Echo2InputError(f"{where}: {field}: {message}" if field else f"{where}: {message}") from None
    unknown = [k for k in workload.sources if not _is_field(k)]
    if unknown:
        raise Echo2InputError(f"{where}: sources name unknown field(s) {', '.join(sorted(unknown))}")
    unknown = [k for k in workload.ranges if k not in UNCERTAIN]
    if unknown:
        raise Echo2InputError(f"{where}: ranges name input(s) the plan does not draw: {', '.join(sorted(unknown))} "
                              f"(it draws {', '.join(UNCERTAIN)})")
    workload.params_b()  # a model is required: say so now
    return workload


def _is_field(dotted: str) -> bool:
    section, _, field = dotted.partition(".")
    part = WorkloadFile.model_fields.get(section)
    if part is None or not field:
        return False
    cls = part.annotation
    return isinstance(cls, type) and issubclass(cls, _Part) and field in cls.model_fields


def from_flags(**sections: dict) -> WorkloadFile:
    """The workload ``echo2 plan``'s flags describe: ``sections`` as in the file (``rollout={...}``), with
    None values left to the defaults. The same object a file gives, so flags and files take one path."""
    data = {name: {k: v for k, v in values.items() if v is not None} for name, values in sections.items()
            if isinstance(values, dict)}
    data.update({name: value for name, value in sections.items() if not isinstance(value, dict) and value is not None})
    return parse_workload(data, where="echo2 plan")
