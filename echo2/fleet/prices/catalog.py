"""The price catalog (``infra/prices/*.csv``) and the worker profiles
(``infra/profiles/rollout-throughput.yaml``) that the fleet planner reads.

A catalog row is one launchable offer: an instance type of a provider in a region, with its GPUs
and its on-demand and spot USD per instance-hour. A profile gives a worker's rollout generation
speed (output tokens per second per GPU, batched sampling) by model size. Both are user input:
a missing or malformed file, or a GPU nobody profiled, is an ``Echo2InputError`` (one line).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from echo2 import shipped
from echo2.errors import Echo2InputError

DEFAULT_CATALOG = shipped.path("prices", "gpu-offers-2026-11.csv")
DEFAULT_PROFILES = shipped.path("profiles", "rollout-throughput.yaml")

COLUMNS = ("provider", "instance_type", "gpu", "gpu_count", "gpu_memory_gib", "region",
           "on_demand_usd_per_hour", "spot_usd_per_hour")

WEIGHT_MEMORY_SHARE = 0.7
"""A model is planned on a GPU only if its bf16 weights take at most this share of the GPU's
memory: batched sampling needs the rest for the KV cache (tensor parallelism is not modelled)."""


@dataclass(frozen=True)
class Offer:
    """One catalog row: what a launch of ``instance_type`` in ``region`` costs and carries."""

    provider: str
    instance_type: str
    gpu: str
    gpu_count: int
    gpu_memory_gib: float | None
    region: str
    on_demand_usd_per_hour: float | None
    spot_usd_per_hour: float | None
    host_memory_gib: float | None = None
    """The instance's host RAM (the catalog's ``memory_gib``); None: unknown. The learner's ranks need it
    (``planner/learner_memory.py``)."""

    def price(self, spot: bool) -> float | None:
        """USD per instance-hour at the spot or the on-demand price (None where the catalog has none)."""
        return self.spot_usd_per_hour if spot else self.on_demand_usd_per_hour

    @property
    def name(self) -> str:
        """provider/instance_type@region: unique within a catalog."""
        return f"{self.provider}/{self.instance_type}@{self.region}"

    def as_dict(self) -> dict:
        """Plain fields plus ``name``, for JSON."""
        return {**asdict(self), "name": self.name}


def gpu_key(name: str) -> str:
    """The spelling-insensitive key of a GPU name: "RTX 4090", "rtx4090" and "RTX4090" match."""
    return "".join(name.split()).upper()


def _price(text: str, where: str) -> float | None:
    if text.strip() == "":
        return None
    try:
        value = float(text)
    except ValueError:
        raise Echo2InputError(f"{where}: price {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise Echo2InputError(f"{where}: price {text!r} must be a finite number >= 0")
    return value if value > 0 else None  # a zero price is "none quoted" (vast writes 0.00 for no spot)


def load_catalog(path: str | Path = DEFAULT_CATALOG, *, spot: bool | None = True) -> list[Offer]:
    """Every offer of the catalog CSV at ``path`` that has the needed price (spot or on-demand;
    ``spot=None``: either, for tools that show or weigh both markets).

    GCP ``gpu-only:`` rows are skipped: they price the accelerator without its host machine, so a
    launch would cost more than the row says."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise Echo2InputError(f"price catalog {path}: {exc.strerror or exc}") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise Echo2InputError(f"price catalog {path} lacks the column(s) {', '.join(missing)}")
    offers = []
    for line, row in enumerate(reader, start=2):
        where = f"price catalog {path} line {line}"
        if any(row.get(c) is None for c in COLUMNS):
            raise Echo2InputError(f"{where}: too few fields")
        if row["instance_type"].startswith("gpu-only:"):
            continue
        try:
            count = float(row["gpu_count"])
            memory = float(row["gpu_memory_gib"]) if row["gpu_memory_gib"].strip() else None
            host = float(row["memory_gib"]) if (row.get("memory_gib") or "").strip() else None
        except ValueError:
            raise Echo2InputError(f"{where}: gpu_count/gpu_memory_gib/memory_gib must be numbers") from None
        if count < 1 or count != int(count):
            raise Echo2InputError(f"{where}: gpu_count {row['gpu_count']!r} must be a whole number >= 1")
        offer = Offer(row["provider"], row["instance_type"], row["gpu"], int(count), memory, row["region"],
                      _price(row["on_demand_usd_per_hour"], where), _price(row["spot_usd_per_hour"], where),
                      host_memory_gib=host if host and host > 0 else None)
        if (offer.price(spot) if spot is not None else offer.price(True) or offer.price(False)) is not None:
            offers.append(offer)
    if not offers:
        market = "" if spot is None else " spot" if spot else "n on-demand"
        raise Echo2InputError(f"price catalog {path} has no offer with a{market} price")
    return offers


def snapshot_info(path: str | Path = DEFAULT_CATALOG) -> dict:
    """Where a catalog snapshot's prices come from and when they were read: the date and the source
    repository named by the README beside it (``infra/prices/README.md``: "# GPU price snapshot --
    DATE", "Repository `owner/name`"), else the month in the file name. Shown in every price table
    so that nobody takes a snapshot for live prices."""
    path = Path(path)
    readme = path.parent / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    if path.name not in text:
        text = ""  # the README describes other files: it says nothing about this one
    date = re.search(r"^#[^\n]*?(\d{4}-\d{2}-\d{2})", text, re.M) or re.search(r"(\d{4}-\d{2}(?:-\d{2})?)", path.name)
    source = re.search(r"Repository `([^`]+)`", text)
    return {"path": str(path), "date": date.group(1) if date else None,
            "source": source.group(1) if source else None}


@dataclass(frozen=True)
class Profile:
    """A worker's rollout speed: output tokens per second per GPU by model size (billions)."""

    name: str
    tokens_per_second: dict[float, float]
    source: str
    aliases: tuple[str, ...] = ()

    moe_bytes_factor: float = 1.5
    """MoE decode: bytes read per generated token over the active weights' bytes (the profile
    file's ``moe.bytes_factor``; see ``speed``)."""
    memory_bandwidth_tb_s: float | None = None
    """The GPU's memory bandwidth (the profile file's ``memory_bandwidth_tb_s``): the decode model's
    roofline (``planner/decode.py``); None: that GPU is planned with ``speed`` alone."""

    def dense_speed(self, model_params_b: float) -> float:
        """Tokens/s per GPU for a dense model of ``model_params_b`` billion parameters: a listed size
        as is; between two listed sizes log-log interpolated; above the largest scaled by 1/params
        (decode reads every weight per token); below the smallest, the smallest's figure (small
        models are overhead-bound, not faster without limit)."""
        sizes = sorted(self.tokens_per_second)
        tps = self.tokens_per_second
        if model_params_b <= sizes[0]:
            return tps[sizes[0]]
        if model_params_b >= sizes[-1]:
            return tps[sizes[-1]] * sizes[-1] / model_params_b
        hi = next(s for s in sizes if s >= model_params_b)
        lo = max(s for s in sizes if s <= model_params_b)
        if hi == lo:
            return tps[lo]
        x = (math.log(model_params_b) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return math.exp(math.log(tps[lo]) + x * (math.log(tps[hi]) - math.log(tps[lo])))

    def speed(self, model_params_b: float, active_params_b: float | None = None) -> float:
        """Tokens/s per GPU for a model of ``model_params_b`` billion parameters in total, of which
        ``active_params_b`` are active per token (a mixture of experts; None: dense).

        Dense: ``dense_speed``. MoE: batched decode is bandwidth-bound on the bytes read per
        generated token, which for an MoE are the ACTIVE weights (each token runs its top-k experts
        and the shared layers), plus the KV cache, plus experts a batch touches beyond each token's
        own. The profile's dense figures already include a dense model's KV reads; the MoE term is
        ``dense_speed(active_params_b * moe_bytes_factor)``: the dense speed of a model whose
        weights are ``moe_bytes_factor`` times the active ones (default 1.5, an estimate stated in
        the profile file: an MoE's KV cache is that of a model as deep as the total -- Qwen3-30B-A3B
        has 48 layers where a dense 3-4B model has 36 -- and fused expert kernels move more bytes
        than a dense matmul of the same active size). It is never slower than the dense model of
        the same total size. Memory (``fits``) follows the total: every expert must be resident."""
        if model_params_b <= 0:
            raise Echo2InputError(f"model size {model_params_b!r} B must be > 0")
        dense = self.dense_speed(model_params_b)
        if active_params_b is None or active_params_b >= model_params_b:
            return dense
        if active_params_b <= 0:
            raise Echo2InputError(f"active parameters {active_params_b!r} B must be > 0")
        return max(dense, self.dense_speed(active_params_b * self.moe_bytes_factor))


def read_yaml(path: Path, what: str) -> object:
    """The YAML document at ``path``, or one ``Echo2InputError`` line naming ``what`` and the path (worker
    profiles here, workload files in ``planner/workload_file.py``)."""
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise Echo2InputError(f"{what} {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise Echo2InputError(f"{what} {path}: not valid YAML ({str(exc).splitlines()[0]})") from None


def load_profiles(path: str | Path = DEFAULT_PROFILES) -> dict[str, Profile]:
    """The worker profiles in the YAML at ``path``, keyed by ``gpu_key`` of every name and alias."""
    path = Path(path)
    data = read_yaml(path, "profiles")
    workers = data.get("workers") if isinstance(data, dict) else None
    if not isinstance(workers, dict) or not workers:
        raise Echo2InputError(f"profiles {path} has no `workers:` mapping")
    moe = data.get("moe") or {}
    try:
        factor = float(moe.get("bytes_factor", Profile.moe_bytes_factor)) if isinstance(moe, dict) else -1.0
    except (TypeError, ValueError):
        factor = -1.0
    if not (math.isfinite(factor) and factor >= 1.0):
        raise Echo2InputError(f"profiles {path}: moe.bytes_factor must be a number >= 1")
    profiles: dict[str, Profile] = {}
    for name, entry in workers.items():
        tps = entry.get("tokens_per_second") if isinstance(entry, dict) else None
        try:
            table = {float(k): float(v) for k, v in (tps or {}).items()}
        except (TypeError, ValueError):
            table = {}
        if not table or any(k <= 0 or v <= 0 or not math.isfinite(v) for k, v in table.items()):
            raise Echo2InputError(f"profiles {path}: workers.{name}.tokens_per_second must map sizes > 0 "
                                  "to tokens/s > 0")
        bandwidth = entry.get("memory_bandwidth_tb_s")
        bandwidth = float(bandwidth) if isinstance(bandwidth, (int, float)) and bandwidth > 0 else None
        profile = Profile(str(name), table, str(entry.get("source", "")), tuple(entry.get("aliases") or ()),
                          moe_bytes_factor=factor, memory_bandwidth_tb_s=bandwidth)
        for key in (profile.name, *profile.aliases):
            profiles[gpu_key(str(key))] = profile
    return profiles


def profile_for(profiles: dict[str, Profile], gpu: str) -> Profile | None:
    """The profile of a catalog GPU name, or None when nobody profiled it."""
    return profiles.get(gpu_key(gpu))


def fits(model_params_b: float, gpu_memory_gib: float | None) -> bool:
    """Whether one replica of the model in bf16 fits one GPU with room for its KV cache; an
    unknown memory size is given the benefit of the doubt."""
    if gpu_memory_gib is None:
        return True
    weights_gib = 2 * model_params_b * 1e9 / 2**30
    return weights_gib <= WEIGHT_MEMORY_SHARE * gpu_memory_gib
