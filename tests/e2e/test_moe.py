"""A mixture-of-experts policy (a tiny random Qwen3-MoE, ``make_tiny_moe_model``) through echo2 like a
dense one: the learner trains it, publishes bf16 keyframes and sparse deltas, actors relay them and
load exactly what was published; two FSDP2 ranks take the step one process takes.

What is specific to MoE here: transformers 5 holds each layer's experts fused, as two 3-D tensors
(``mlp.experts.gate_up_proj`` (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)), while the Hub's
checkpoint (what ``save_pretrained`` writes) has one 2-D tensor per expert and projection. The learner
loads the Hub layout and publishes what its model holds, the fused one; both must load in the actor's
engine and in ``from_pretrained`` to the same weights, and the delta encoder must carry 3-D tensors.
The router's load-balancing loss is not part of echo2's loss (see the README's MoE section).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from distributed_step import tables
from helpers import teach_sums, wait_until
from relay_run import both_hold, delta_relay_run, engine_loads, hashes, published_versions
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from echo2.bench.tiny_model import make_tiny_moe_model
from echo2.cli import app
from echo2.config import TrainConfig
from echo2.data import layout
from echo2.data.delta import apply_delta, encode_delta
from echo2.data.weights import unique_state_dict
from echo2.learner.checkpoint import load_checkpoint
from echo2.learner.learner import Learner
from echo2.rollout.engines.transformers import TransformersEngine
from echo2.rollout.engines.vllm import hub_layout

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
STEPS = 2


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("tiny-moe"))


def test_fused_experts_load_from_the_hub_layout_and_from_what_the_learner_publishes(moe_model, tmp_path):
    """The tiny model's checkpoint is in the Hub's per-expert layout; in memory the experts are 3-D tensors;
    a folder of those in-memory tensors (a published version) loads in ``from_pretrained`` and in the
    actor's engine to the same weights, and a delta between two of them applies bit for bit."""
    saved = load_file(moe_model / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in saved and not any(k.endswith(EXPERTS) for k in saved)
    model = AutoModelForCausalLM.from_pretrained(moe_model)
    assert model.config.output_router_logits is False  # so the router's aux loss is not even computed
    published = unique_state_dict(model, torch.bfloat16)
    assert published["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert published["model.layers.1.mlp.experts.down_proj"].shape == (4, 32, 16)

    folder = tmp_path / "published"
    folder.mkdir()
    save_file(published, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_bytes((moe_model / "config.json").read_bytes())
    loaded, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), info
    assert hashes(unique_state_dict(loaded)) == hashes(published)
    engine = TransformersEngine(moe_model, eos_token_id=0, pad_token_id=0, dtype="bfloat16")
    engine.load_weights(published.items())
    assert hashes(unique_state_dict(engine.model)) == hashes(published)

    # a step that moves one expert of one layer: the delta names the 3-D tensor and rebuilds it exactly
    moved = {k: v.clone() for k, v in published.items()}
    moved["model.layers.0.mlp.experts.down_proj"][2] += 0.5
    delta = encode_delta(published, moved, max_file_bytes=2**20)
    rebuilt = {k: v.clone() for k, v in published.items()}
    apply_delta(rebuilt, delta.files, delta.table)
    assert hashes(rebuilt) == hashes(moved)
    changed = {name for name, entry in delta.table.items() if entry.get("changed")}
    assert changed == {"model.layers.0.mlp.experts.down_proj"}, delta.table


def test_the_vllm_engine_writes_a_version_in_the_hub_layout_its_loader_reads(moe_model, tiny_model, tmp_path):
    """vLLM's Qwen3-MoE loader reads per-expert names (``mlp.experts.0.gate_proj.weight``), not transformers'
    fused ones: the vLLM engine converts a published version back to the Hub layout before its reload, to
    exactly the tensors ``save_pretrained`` writes. A dense model's version passes through unchanged.
    (vLLM itself is not installed here: the reload is not run with an MoE model.)"""
    def skeleton(path):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))

    published = unique_state_dict(AutoModelForCausalLM.from_pretrained(moe_model))
    hub = hub_layout(skeleton(moe_model), published)
    saved = load_file(moe_model / "model.safetensors")
    assert hub.keys() == saved.keys() and all(torch.equal(hub[k], saved[k]) for k in saved)
    save_file(hub, str(tmp_path / "weights.safetensors"))  # no two tensors share storage
    dense = unique_state_dict(AutoModelForCausalLM.from_pretrained(tiny_model))
    same = hub_layout(skeleton(tiny_model), dense)
    assert same.keys() == dense.keys() and all(same[k] is dense[k] for k in dense)


def test_the_learner_recomputes_the_engines_behavior_logprobs_on_the_moe(moe_model):
    """The actor's engine (left-padded batches, a KV cache) and the learner (one packed row) route every token
    alike, so the learner's fp32 log-probabilities are the engine's (tests/e2e/test_learner.py's check, on the MoE)."""
    import test_learner

    test_learner.test_recomputed_logprobs_on_a_packed_batch_equal_the_engines(moe_model)


@pytest.mark.e2e
def test_a_moe_run_publishes_bf16_deltas_that_relaying_actors_load_exactly(moe_model, tmp_path, monkeypatch):
    records = tmp_path / "records"
    records.mkdir()
    monkeypatch.setenv("ECHO2_TEST_RECORDS", str(records))
    # sampled, it answers about 40% of sums right after these steps (measured): most groups of 8 carry a
    # reward signal, so the steps move the weights
    model = teach_sums(moe_model, tmp_path / "answering-moe", steps=110)
    run, fleet = delta_relay_run(tmp_path, model, run_id="moe", steps=STEPS, actors=2, groups_per_batch=2, lr=1e-4,
                                 keyframe_every=100)

    fleet.start()
    try:
        while run.step < STEPS:
            # the next version waits until both actors hold this one, so that each is relayed (both_hold)
            wait_until(lambda: both_hold(run, run.step), 120, f"both actors on v{run.step}")
            run.update(run.collect(should_abort=fleet.reconcile))
        wait_until(lambda: both_hold(run, STEPS), 120, f"both actors on v{STEPS}")
    finally:
        fleet.stop()
    run.finish()

    store = run.store
    manifests, published = published_versions(store, STEPS)
    assert [m["weights"] for m in manifests.values()] == ["full"] + ["delta"] * STEPS
    experts = [n for n in published[0] if n.endswith(EXPERTS)]
    assert len(experts) == 4 and all(manifests[0]["tensors"][n]["shape"][0] == 4 for n in experts)
    # the steps moved the weights, the experts' among them: a delta carries changed 3-D expert tensors
    history = json.loads(store.get(layout.report_key("metrics.json")))
    assert published[STEPS] != published[0], [m["groups_with_signal"] for m in history]
    assert any(manifests[v]["tensors"][n].get("changed") for v in range(1, STEPS + 1) for n in experts)

    loads = engine_loads(run, records, published)  # every engine load, byte for byte the learner's version
    assert len(loads) == 2
    for actor, (swapped, _) in loads.items():
        assert swapped == list(range(STEPS + 1)), (actor, swapped)
    logs = {actor: log for actor, (_, log) in loads.items()}
    received = re.findall(r"v\d+ received and verified \(.*", "\n".join(logs.values()))
    assert any(re.search(r"from actor\S+ at http://127.0.0.1", line) for line in received), received

    # `echo2 export` of the last version (a delta) rebuilds it; from_pretrained loads exactly it
    dest = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export", store.url, str(dest)])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(dest)
    assert hashes(unique_state_dict(exported, torch.bfloat16)) == published[STEPS]

    # the run's last checkpoint (a sharded one, written at the last step) restores a fresh learner to that version
    fresh = Learner(model, TrainConfig(), temperature=1.0)
    load_checkpoint(store, STEPS, run.key.public_key(),
                    lambda ckpt: fresh.load_sharded(store, ckpt.prefix, ckpt.entries))
    assert hashes(unique_state_dict(fresh.model, torch.bfloat16)) == published[STEPS]
    assert fresh.optimizer.state  # the AdamW moments came back too


def test_the_routers_load_balancing_loss_is_not_part_of_the_loss(moe_model, tmp_path):
    """A documented deviation: transformers adds the router's auxiliary loss in the causal LM's forward (with
    ``output_router_logits`` on and labels given); echo2 runs the decoder and its own head, so even a config
    asking for it with a large coefficient takes exactly the step of one that does not."""
    import shutil

    asking = tmp_path / "asking"
    shutil.copytree(moe_model, asking)
    config = json.loads((asking / "config.json").read_text())
    config.update(output_router_logits=True, router_aux_loss_coef=1.0)
    (asking / "config.json").write_text(json.dumps(config))
    steps = []
    for model_dir in (moe_model, asking):
        torch.manual_seed(0)
        steps.append(Learner(model_dir, TrainConfig(lr=1e-3), temperature=1.0).train_step(tables()))
    assert steps[0]["groups_with_signal"] > 0
    assert (steps[0]["loss"], steps[0]["grad_norm"]) == (steps[1]["loss"], steps[1]["grad_norm"])


def test_lora_on_moe_adapts_named_modules_and_refuses_the_fused_experts(moe_model):
    """peft's ``all-linear`` on this model also adapts the fused experts and the router (parameters, which
    echo2's merge cannot fold in): refused before any step, in one line naming what to set. Named attention
    projections train, and the merged weights are the base plus exactly those modules' updates."""
    with pytest.raises(ValueError, match=r"mlp.experts|gate_up_proj") as refused:
        Learner(moe_model, TrainConfig(lora_rank=4), temperature=1.0)
    assert "train.lora_target_modules" in str(refused.value)
    learner = Learner(moe_model, TrainConfig(lora_rank=4, lr=1e-2, lora_target_modules=["q_proj", "v_proj"]),
                      temperature=1.0)
    base = {k: v.clone() for k, v in learner.base_tensors.items()}
    for _ in range(2):  # B starts at 0: the second step is the first to move the merged weights
        assert learner.train_step(tables())["groups_with_signal"] > 0
    merged = learner.full_tensors()
    moved = {k for k in base if not torch.equal(merged[k], base[k])}
    assert moved == {f"model.layers.{i}.self_attn.{m}.weight" for i in range(2) for m in ("q_proj", "v_proj")}, moved


BF16 = {"loss": 1e-3, "grad_norm": 1e-3, "update": 0.3}
"""bf16, 2 ranks against one process, relative (as test_distributed.BF16 for the dense model): loss, gradient
norm, and the AdamW update over all weights. Measured 2026-12-03: loss 4.6e-5, gradient norm 2.4e-4, update 0.20
(the dense model's 0.10; the routers' alone 0.17-0.39): besides bf16 rounding in other places and AdamW's first
step turning the sign of every small gradient element into a full step, a token whose top router scores are
within bf16 rounding of each other goes to another expert in one of the two runs."""


def _distributed_step(model_dir, out, nproc: int) -> dict:
    """tests/support/distributed_step.py (the dense model's 2-ranks-equal-1-process step, every issue-19 option on) on
    ``model_dir``, cases fp32 and bf16: rank 0's metrics per case."""
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 \
        else [sys.executable]
    script = str(REPO / "tests" / "support" / "distributed_step.py")
    proc = subprocess.run([*prefix, script, str(model_dir), str(out), "fp32", "bf16"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {m["case"]: m for m in lines if "world" in m}


@pytest.mark.e2e
def test_two_fsdp_ranks_take_the_moe_step_one_process_takes(moe_model, tmp_path):
    """Each decoder layer (attention, router and fused experts together) is one FSDP2 unit, its 3-D expert
    tensors sharded on the expert dimension (2 of the 4 experts a rank): no expert parallelism. Packs, chunked
    log-probabilities and activation checkpointing on; fp32 up to float order, bf16 within ``BF16``."""
    one = _distributed_step(moe_model, tmp_path / "one.safetensors", 1)
    two = _distributed_step(moe_model, tmp_path / "two.safetensors", 2)
    for case in ("fp32", "bf16"):
        assert one[case]["world"] == 1 and two[case]["world"] == 2
        assert one[case]["groups_with_signal"] == two[case]["groups_with_signal"] > 0
    f1, f2 = one["fp32"], two["fp32"]
    assert abs(f1["loss"] - f2["loss"]) < 1e-6 and abs(f1["grad_norm"] - f2["grad_norm"]) < 1e-5, (f1, f2)
    a, b = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    assert a.keys() == b.keys() and {f"model.layers.1.{n}" for n in EXPERTS} <= a.keys()
    initial = AutoModelForCausalLM.from_pretrained(moe_model).state_dict()
    for name in a:  # every weight moved, the experts and the router included; and moved alike on 2 ranks
        assert (a[name] - initial[name]).abs().max() > 1e-4, name
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    c, d = load_file(tmp_path / "one.bf16.safetensors"), load_file(tmp_path / "two.bf16.safetensors")
    update = (sum(((d[k] - c[k]).double() ** 2).sum() for k in c) /
              sum(((c[k] - initial[k]).double() ** 2).sum() for k in c)).sqrt().item()
    b1, b2 = one["bf16"], two["bf16"]
    loss, grad_norm = (abs(b2[m] - b1[m]) / abs(b1[m]) for m in ("loss", "grad_norm"))
    print(f"MoE, 2 ranks vs 1 process: fp32 largest weight difference {worst:.2e}; bf16 loss {loss:.1e}, "
          f"grad norm {grad_norm:.1e}, update {update:.2f} relative")
    assert worst < 1e-5
    assert loss < BF16["loss"] and grad_norm < BF16["grad_norm"] and update < BF16["update"], (b1, b2, update)


@pytest.mark.parametrize("moe", [True, False])
def test_the_run_tells_the_fleet_a_moes_active_size(moe, moe_model, tiny_model, tmp_path, monkeypatch):
    """A mixture of experts decodes at the speed of its active weights: the flow hands the fleet the policy's
    active size (``LearnerRun.active_params_b``), so a live fleet is not priced as a dense model of its total."""
    from echo2.config import config_from_dict
    from echo2.data.store import open_store
    from echo2.learner.run import LearnerRun

    monkeypatch.setenv("ECHO2_SECRETS", str(tmp_path / "secrets"))
    config = config_from_dict({
        "run": {"id": "moe-size"}, "store": {"url": str(tmp_path / "store")},
        "model": {"name": str(moe_model if moe else tiny_model)},
        "train": {"max_steps": 1}, "learner": {"num_threads": 1}, "eval": {"before": False, "after": False}})
    run = LearnerRun(config, open_store(str(tmp_path / "store")).child(layout.RUNS), resume=False)
    total, active = run.model_params_b, run.active_params_b
    if not moe:
        assert active is None
        return
    c = AutoConfig.from_pretrained(moe_model)
    # the experts' MLP weights of the unrouted experts are what a token skips
    unrouted = c.num_local_experts - c.num_experts_per_tok
    skipped = c.num_hidden_layers * unrouted * 3 * c.hidden_size * c.moe_intermediate_size
    assert active == pytest.approx(total - skipped / 1e9, rel=0.02)


def _expert_matmul_dtypes(learner: Learner) -> set:
    """The dtypes the experts' grouped matmuls multiply in, over one step's forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "grouped_mm" in str(func):
                seen.update(str(a.dtype) for a in args[:2] if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    with Record():
        learner.train_step(tables())
    return seen


def test_one_process_computes_the_experts_in_bf16_when_it_shards(moe_model, one_rank_group):
    """bf16 compute in one process reaches the experts only through FSDP2's mixed precision (what one GPU runs):
    under autocast the experts' grouped matmul casts its input to the fp32 weights (grouped_mm is not autocast-aware),
    so an autocast step multiplies the experts in fp32."""
    autocast = Learner(moe_model, TrainConfig(dtype="bfloat16"), temperature=1.0, sharded=False)
    assert _expert_matmul_dtypes(autocast) == {"torch.float32"}
    sharded = Learner(moe_model, TrainConfig(dtype="bfloat16"), temperature=1.0, sharded=True)
    assert sharded.sharded and sharded.world_size == 1
    assert _expert_matmul_dtypes(sharded) == {"torch.bfloat16"}
    assert {p.dtype for p in sharded.model.parameters()} == {torch.float32}  # the master weights stay fp32
