"""``echo2 bench``: benchmarks that print ratios measured side by side (each also has its ``make bench-NAME``);
the benchmarks themselves are in ``echo2/bench/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from echo2.cli.common import fail, quiet_transformers
from echo2.errors import Echo2InputError

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured side by side.")


@bench_app.command("broadcast")
def bench_broadcast(
    receivers: Optional[List[int]] = typer.Option(None, "--receivers",
                                                  help="Receiver counts (repeatable; default 2 4 8 16)."),
    size_mb: float = typer.Option(256.0, "--size-mb", help="Payload (one policy version) in MB."),
    link_mbit: float = typer.Option(200.0, "--link-mbit", help="Every node's uplink, the store's too."),
    chunk_mb: float = typer.Option(1.0, "--chunk-mb", help="Chunk size: smaller chunks fill a long chain sooner."),
    fanout: int = typer.Option(1, "--fanout", help="Relay fan-out (1 = chain)."),
    loopback: bool = typer.Option(False, "--loopback", help="Skip namespaces and tc: unshaped loopback."),
    tls: bool = typer.Option(False, "--tls", help="Also run the relay chain over mutual TLS, beside the plain one."),
    rtt_ms: float = typer.Option(0.0, "--rtt-ms", help="Round trip every request pays (a delaying TCP forwarder "
                                 "in front of every node's server; echo2/bench/wan.py)."),
    uplinks: Optional[str] = typer.Option(None, "--uplinks", help="Receivers' uplinks in Mbit/s, cycled over them "
                                          "(e.g. 25,100,200,1000), or a mix: wan, home, cloud. The store keeps "
                                          "--link-mbit."),
    churn: float = typer.Option(0.0, "--churn", help="Share of receivers killed mid-version (each when half the "
                                "version is in it), as many joining: a further run beside the one without."),
    store_only: bool = typer.Option(True, "--store-only/--no-store-only", help="Also every receiver from the store."),
    wan_targets: bool = typer.Option(False, "--wan", help="The four wide-area scenarios side by side, each beside its "
                                     "target (--size-mb for A-C, default 64; today's rows at 256 MB)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object per receiver count)."),
    delta: bool = typer.Option(False, "--delta", help="Sparse delta vs full bf16 versions of a real quickstart run: "
                               "sizes, encode/apply time, then the relay time of each (one object per version "
                               "with --json, then one for the relay)."),
    steps: int = typer.Option(6, "--steps", help="With --delta: training steps (consecutive versions) to measure."),
    from_run: Optional[str] = typer.Option(None, "--from-run", help="With --delta: measure this run's versions "
                                           "(STORE/runs/ID, every version still kept) instead of training."),
) -> None:
    """Relay vs store-only dissemination across network namespaces with tc-shaped links."""
    from echo2.bench.broadcast import MAX_RECEIVERS, namespaces_available, run_broadcast_bench
    from echo2.bench.wan import parse_uplinks

    try:
        rates = parse_uplinks(uplinks)
        if bad := [n for n in receivers or [] if not 1 <= n <= MAX_RECEIVERS]:
            raise Echo2InputError(f"--receivers {bad[0]}: between 1 and {MAX_RECEIVERS}")
        if not 0 <= churn < 1:
            raise Echo2InputError(f"--churn {churn:g} is not a share of the receivers in [0, 1)")
        if not 0 <= rtt_ms <= 2000:
            raise Echo2InputError(f"--rtt-ms {rtt_ms:g} is not in [0, 2000]")
    except Echo2InputError as exc:
        fail(str(exc))
    shaped = False if loopback else namespaces_available()
    if wan_targets:
        _bench_wan(size_mb=64.0 if size_mb == 256.0 else size_mb, chunk_mb=chunk_mb, shaped=shaped, as_json=as_json)
        return
    if delta:
        _bench_delta(steps=steps, receivers=(receivers or [8])[0], link_mbit=link_mbit, chunk_mb=chunk_mb,
                     shaped=shaped, from_run=from_run, as_json=as_json)
        return
    counts = receivers or [2, 4, 8, 16]
    results = []
    for n in counts:
        result = run_broadcast_bench(n, size_mb, link_mbit, chunk_mb=chunk_mb, fanout=fanout, shaped=shaped, tls=tls,
                                     rtt_ms=rtt_ms, uplinks=rates, churn=churn, store_only=store_only)
        results.append(result)
        if as_json:
            typer.echo(json.dumps(result))
    if as_json:
        return
    from rich.console import Console
    from rich.table import Table

    wide = bool(rtt_ms or rates or churn)
    links = f"uplinks {uplinks} (store {link_mbit:g})" if rates else f"{link_mbit:g} Mbit/s links"
    table = Table(title=f"broadcast of {size_mb:g} MB, {links}, {chunk_mb:g} MB chunks, fan-out {fanout}"
                        + (f", RTT {rtt_ms:g} ms" if rtt_ms else "") + (f", churn {churn:g}" if churn else "")
                        + f" ({results[0]['network']})")
    for col in _columns(tls=tls, wide=wide, churn=bool(churn), store_only=store_only):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(*_row(r, tls=tls, wide=wide, churn=bool(churn), store_only=store_only))
    Console(width=220).print(table)
    by_n = {r["receivers"]: r for r in results}
    if 4 in by_n and 16 in by_n:
        typer.echo(f"relay time N=16 / N=4: {by_n[16]['relay_s'] / by_n[4]['relay_s']:.2f}")


def _bench_wan(*, size_mb: float, chunk_mb: float, shaped: bool, as_json: bool) -> None:
    from echo2.bench.broadcast import run_wan_targets

    result = run_wan_targets(size_mb=size_mb, chunk_mb=chunk_mb, shaped=shaped,
                             progress=lambda line: typer.echo(line, err=True))
    if as_json:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)
    sc = result["scenarios"]
    for title, rows, wide, churn, store_only in [
            (f"A: {size_mb:g} MB, 200 Mbit/s links, RTT 80 ms", [sc["A"]], True, False, True),
            (f"A: the same, {sc['A_small']['chunk_mb']:g} MB chunks (relay only)", [sc["A_small"]], False, False,
             False),
            (f"B, C: {size_mb:g} MB, uplinks 25/100/200/1000 (store 200), RTT 40 ms, churn 0.25", [sc["B+C"]],
             True, True, False),
            ("D: today's rows, 256 MB, 200 Mbit/s links, no RTT", sc["D"], False, False, False)]:
        pieces = "" if "chunks" in title else f", {chunk_mb:g} MB chunks"
        table = Table(title=f"{title}{pieces}, fan-out {rows[0]['fanout']} ({rows[0]['network']})")
        for col in _columns(tls=False, wide=wide, churn=churn, store_only=store_only):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(*_row(r, tls=False, wide=wide, churn=churn, store_only=store_only))
        console.print(table)
    table = Table(title="wide-area targets, as measured in this run")
    for col in ["scenario", "measure", "measured", "target", "met"]:
        table.add_column(col, justify="right")
    for c in result["checks"]:
        table.add_row(c["scenario"], c["measure"], str(c["measured"]), c["target"],
                      "-" if c["met"] is None else "yes" if c["met"] else "NO")
    console.print(table)


def _columns(*, tls: bool, wide: bool, churn: bool, store_only: bool) -> list[str]:
    """Today's columns, then the wide-area ones (lower bound, rotating chain, churn) where asked."""
    cols = ["receivers", "relay s"] + (["store-only s"] if store_only else []) + ["ideal s", "relay/ideal"]
    cols += ["store-only/relay"] if store_only else []
    cols += ["relay TLS s", "TLS/plain"] if tls else []
    cols += ["lower bound s", "relay/bound", "rotating chain s", "chain/relay"] if wide else []
    cols += ["churn tail s", "churn/no-churn"] if churn else []
    return cols + ["verified"]


def _row(r: dict, *, tls: bool, wide: bool, churn: bool, store_only: bool) -> list[str]:
    row = [str(r["receivers"]), f"{r['relay_s']:.2f}"] + ([f"{r['store_only_s']:.2f}"] if store_only else [])
    row += [f"{r['ideal_s']:.2f}", f"{r['relay_over_ideal']:.2f}"]
    row += [f"{r['store_only_over_relay']:.2f}"] if store_only else []
    row += [f"{r['relay_tls_s']:.2f}", f"{r['tls_over_plain']:.2f}"] if tls else []
    row += [f"{r['lower_bound_s']:.2f}", f"{r['relay_over_lower_bound']:.2f}", f"{r['rotating_chain_s']:.2f}",
            f"{r['rotating_over_relay']:.2f}"] if wide else []
    row += [f"{r['tail_s']:.2f}", f"{r['churn_over_no_churn']:.2f}"] if churn else []
    return row + [str(r["verified"])]


def _bench_delta(*, steps: int, receivers: int, link_mbit: float, chunk_mb: float, shaped: bool,
                 from_run: str | None, as_json: bool) -> None:
    from echo2.bench.delta import json_lines, print_delta, run_delta_bench
    from echo2.data.store import StoreError

    quiet_transformers()
    try:
        result = run_delta_bench(steps=steps, receivers=receivers, link_mbit=link_mbit, chunk_mb=chunk_mb,
                                 shaped=shaped, from_run=from_run, progress=lambda line: typer.echo(line, err=True))
    except (StoreError, ValueError) as exc:
        fail(str(exc))
    if as_json:
        for obj in json_lines(result):
            typer.echo(json.dumps(obj))
    else:
        print_delta(result)


@bench_app.command("overlap")
def bench_overlap(
    quick: bool = typer.Option(False, "--quick", help="Two or three points with a short step (under a minute)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: a list of grid points."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep the run folders and actor logs in this directory."),
) -> None:
    """Capacity model vs the real learner and actors on a timing workload: utilization, predicted and measured."""
    from echo2.bench.overlap import print_table, run_overlap_bench, summary_line

    quiet_transformers()
    results = run_overlap_bench(quick=quick, keep=keep, progress=lambda line: typer.echo(line, err=True))
    if as_json:
        typer.echo(json.dumps(results, indent=1))
    else:
        print_table(results)
    typer.echo(summary_line(results), err=as_json)


@bench_app.command("refill")
def bench_refill(
    groups: int = typer.Option(256, "--groups", help="Prompt groups generated in each mode."),
    group_size: int = typer.Option(4, "--group-size", help="G: completions per prompt."),
    groups_per_batch: int = typer.Option(8, "--groups-per-batch", help="Groups per batch (and in flight with refill)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Longest completion."),
    mean_tokens: float = typer.Option(16.0, "--mean-tokens", help="Mean completion length aimed at (geometric)."),
    repeats: int = typer.Option(3, "--repeats", help="Repeats, the modes' order alternating; the median ratio."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: settings, repeats, ratio."),
) -> None:
    """Rollout throughput with rollout.refill against batch by batch, side by side, on mixed completion lengths."""
    from echo2.bench.refill import Settings, print_result, run_refill_bench, summary_line

    if min(groups, group_size, groups_per_batch, max_new_tokens, repeats) < 1 or mean_tokens <= 1:
        fail("--groups, --group-size, --groups-per-batch, --max-new-tokens and --repeats must be >= 1, "
             "--mean-tokens > 1")
    quiet_transformers()
    settings = Settings(groups=groups, group_size=group_size, groups_per_batch=groups_per_batch,
                        max_new_tokens=max_new_tokens, mean_tokens=mean_tokens, repeats=repeats)
    result = run_refill_bench(settings, progress=lambda line: typer.echo(line, err=True))
    if as_json:
        typer.echo(json.dumps(result, indent=1))
    else:
        print_result(result)
    typer.echo(summary_line(result), err=as_json)


@bench_app.command("cost")
def bench_cost(
    rollouts_per_second: float = typer.Option(32.0, "--rollouts-per-second",
                                              help="R: rollouts (completions) per second the fleet must make."),
    model_params: float = typer.Option(4.0, "--model-params",
                                       help="Model size in billions (speeds interpolated between profiled sizes)."),
    completion_tokens: float = typer.Option(512.0, "--completion-tokens", help="Mean output tokens per rollout."),
    source: str = typer.Option("snapshot", "--source", help="Price source: snapshot, aws, skypilot."),
    reclaim_rate: Optional[List[str]] = typer.Option(None, "--reclaim-rate", help="Reclaims per instance-hour: "
                                                     "KEY=RATE, KEY = spot, on-demand, provider, provider:market or "
                                                     "offer (repeatable)."),
    cap: Optional[List[str]] = typer.Option(None, "--cap",
                                            help="Instances per offer at most: KEY=N, same keys (repeatable)."),
    recovery_seconds: float = typer.Option(600.0, "--recovery-seconds",
                                           help="Work lost per reclaim: until a replacement produces."),
    max_usd_per_hour: Optional[float] = typer.Option(None, "--max-usd-per-hour", help="Budget for activation's fleet."),
    measured_run: Optional[List[str]] = typer.Option(None, "--measured-run", help="Earlier run whose measured speeds "
                                                     "replace the profiles' (repeatable)."),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep",
                               help="Also both figures at 8, 32, 128, 512, 1024 rollouts/s."),
    store: str = typer.Option("aws:us-east-1", "--store", help="Where the object store lives, PROVIDER:REGION "
                              "(prices the traffic column)."),
    run_versions: int = typer.Option(1000, "--run-versions", help="Versions (learner steps) in the run the traffic "
                                     "column prices."),
    run_hours: float = typer.Option(10.0, "--run-hours", help="Hours of that run (GPU dollars beside the traffic)."),
    keyframe_every: int = typer.Option(16, "--keyframe-every", help="A full version every K (publish.keyframe_every)."),
    changed_fraction: Optional[float] = typer.Option(None, "--changed-fraction", help="Share of the bf16 weights a "
                                                     "step changes (default: measured here, 2.1%)."),
    from_run: Optional[str] = typer.Option(None, "--from-run", help="Read the changed fraction from this run's "
                                           "metrics (a run that published sparse deltas)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Activation's fleet $/h vs an all-on-demand single-GPU-type fleet of equal throughput, and each fleet's traffic
    per run with the relay against every actor reading the store."""
    from echo2.bench.cost import SWEEP, print_cost, run_cost_bench
    from echo2.fleet.planner.dissemination import DEFAULT_CHANGED_FRACTION, changed_fraction_from_run

    try:
        if from_run and changed_fraction is not None:
            raise Echo2InputError("give --changed-fraction or --from-run, not both")
        changed = changed_fraction_from_run(from_run) if from_run else changed_fraction
        result = run_cost_bench(rollouts_per_second=rollouts_per_second, model_params_b=model_params, source=source,
                                completion_tokens=completion_tokens, reclaim=reclaim_rate, caps=cap,
                                recovery_seconds=recovery_seconds, budget_usd_per_hour=max_usd_per_hour,
                                measured_runs=measured_run, sweep=SWEEP if sweep else None, store=store,
                                run_versions=run_versions, run_hours=run_hours, keyframe_every=keyframe_every,
                                changed_fraction=DEFAULT_CHANGED_FRACTION if changed is None else changed)
    except Echo2InputError as exc:
        fail(str(exc))
    typer.echo(json.dumps(result, indent=1)) if as_json else print_cost(result)
    if result["activation_usd_per_hour"] is None:
        raise typer.Exit(1)


@bench_app.command("learner")
def bench_learner(
    device: str = typer.Option("cpu", "--device", help="cpu, or cuda (bf16 autocast, checkpointed layers, MFU)."),
    model_config: Optional[str] = typer.Option(None, "--model-config", help="With --device cuda: a real shape at "
                                               "random weights: qwen3-1.7b, qwen3-8b, qwen3-30b-a3b."),
    layers: Optional[int] = typer.Option(None, "--layers", help="With --model-config: keep only this many layers."),
    vocab: int = typer.Option(151_936, "--vocab", help="The CPU model's vocabulary (Qwen3's by default)."),
    hidden: int = typer.Option(128, "--hidden", help="The CPU model's hidden size."),
    completion_tokens: Optional[List[int]] = typer.Option(None, "--completion-tokens", help="Fixed-length cases "
                                                          "(repeatable; default 512 2048 8192)."),
    mixed: str = typer.Option("64..4096", "--mixed", help="LOW..HIGH completion tokens of the mixed case, or none."),
    cases: Optional[List[str]] = typer.Option(None, "--cases", help="Run only these cases (repeatable)."),
    prompt_tokens: int = typer.Option(256, "--prompt-tokens"),
    groups: int = typer.Option(2, "--groups"),
    group_size: int = typer.Option(8, "--group-size"),
    micro_batch_tokens: Optional[int] = typer.Option(None, "--micro-batch-tokens", help="echo2's token budget "
                                                     "(default 4096 on CPU, 8192 on GPU)."),
    chunk_tokens: Optional[int] = typer.Option(None, "--chunk-tokens", help="echo2's log-prob chunk (default 128 "
                                               "on CPU, 1024 on GPU)."),
    baseline_micro_batch: Optional[int] = typer.Option(None, "--baseline-micro-batch", help="Baseline rows per "
                                                       "micro-batch (default: the largest that fits the budget)."),
    memory_budget_mb: Optional[float] = typer.Option(None, "--memory-budget-mb", help="The baseline's memory "
                                                     "(default 60% of available RAM; 85% of the GPU's free memory)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Measured steps per variant (default 3; 5 on GPU)."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Unmeasured steps first (default 0; 1 on GPU)."),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per case."),
) -> None:
    """The learner's training step vs the old padded full-logits step: memory, tokens/s, MFU."""
    from echo2.bench.learner import build, run_and_report
    from echo2.bench.learner_report import table_rows

    quiet_transformers()
    try:
        chosen, opts = build(device=device, model_config=model_config, layers=layers, vocab=vocab, hidden=hidden,
                             completion_tokens=completion_tokens or [512, 2048, 8192], mixed=mixed, cases=cases,
                             prompt_tokens=prompt_tokens, groups=groups, group_size=group_size,
                             micro_batch_tokens=micro_batch_tokens, chunk_tokens=chunk_tokens,
                             baseline_micro_batch=baseline_micro_batch, memory_budget_mb=memory_budget_mb,
                             steps=steps, warmup=warmup, seed=seed)
    except ValueError as exc:
        fail(str(exc))

    def rich_table(results: list[dict]) -> None:
        from rich.console import Console
        from rich.table import Table

        headers, rows = table_rows(results)
        table = Table(title="echo2 bench learner (MB above model + grads + AdamW)")
        for header in headers:
            table.add_column(header, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=200).print(table)

    code = run_and_report(chosen, opts, as_json=as_json, model_config=model_config, table=rich_table)
    if code:
        raise typer.Exit(code)


@bench_app.command("gpu-check")
def bench_gpu_check(
    out: Path = typer.Option(Path("."), "--out", help="Folder of gpu_check.jsonl (every number, one JSON line each)."),
    budget_s: float = typer.Option(480.0, "--budget-s", help="Sections after this many seconds are skipped."),
    device: str = typer.Option("cuda", "--device", help="cuda, or cpu with --tiny."),
    model_config: str = typer.Option("qwen3-1.7b", "--model-config", help="The shape the speed and memory are "
                                     "measured at (echo2/bench/learner_configs)."),
    tiny: bool = typer.Option(False, "--tiny", help="Tiny models and cases: a smoke run in seconds."),
    only: str = typer.Option("", "--only", help="Comma-separated sections (env always runs)."),
) -> None:
    """One short check of the learner on a GPU: the chunked head, packing, the real step against the old one (fp32,
    bf16), varlen against sdpa, tokens/s, MFU and memory, MoE experts, a DCP round trip; ends with one SUMMARY line.
    `python -m echo2.bench.gpu_check` is the same where only torch and transformers are installed."""
    from echo2.bench.gpu_check import main

    quiet_transformers()
    argv = ["--out", str(out), "--budget-s", str(budget_s), "--device", device, "--model-config", model_config,
            "--only", only] + (["--tiny"] if tiny else [])
    code = main(argv)
    if code:
        raise typer.Exit(code)


@bench_app.command("staleness")
def bench_staleness(
    config: str = typer.Option("configs/quickstart.yaml", "--config", help="The task, model and run shape swept."),
    staleness: Optional[List[int]] = typer.Option(None, "--staleness", "-S", help="S values (repeatable; default "
                                                  "0 1 2 4 8, --quick: 0 2)."),
    seeds: Optional[List[int]] = typer.Option(None, "--seed", help="Seeds, each S trained once per seed (default 0); "
                                              "two or more give the interval over seeds."),
    steps: Optional[int] = typer.Option(None, "--steps", help="train.max_steps of every run (default: the config's)."),
    actors: Optional[int] = typer.Option(None, "--actors", help="fleet.actors of every run (default 2: enough for "
                                         "the lag to reach S here, bench/staleness.py; --quick: the config's)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="More key=value settings for every run."),
    quick: bool = typer.Option(False, "--quick", help="Smoke form: a tiny random model, two steps at S = 0 and 2."),
    plot: Path = typer.Option(Path("reports/staleness.png"), "--plot", help="Where the curves are drawn."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep the run folders in this directory."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: one object per S."),
) -> None:
    """The same task, model and seeds trained at each S: final held-out metric (95% interval), reward area, mean lag,
    wall time and learner utilization per S, and one plot of the curves."""
    from echo2.bench import staleness as bench

    values = tuple(staleness or (bench.QUICK_STALENESS if quick else bench.DEFAULT_STALENESS))
    if any(s < 0 for s in values):
        fail(f"--staleness values must be >= 0, not {sorted(values)}")
    if actors is None and not quick:
        actors = bench.DEFAULT_ACTORS
    sweep = bench.Sweep(config=config, staleness=values, seeds=tuple(seeds or (0,)), steps=steps, actors=actors,
                        overrides=list(set_ or []))
    try:
        rows = bench.run_staleness_bench(sweep, quick=quick, keep=keep,
                                         progress=lambda line: typer.echo(line, err=True))
    except RuntimeError as exc:
        fail(str(exc))
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot.write_bytes(bench.staleness_png(rows))
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"echo2 bench staleness ({config}, seeds {list(sweep.seeds)})")
    for header in bench.COLUMNS:
        table.add_column(header, justify="right")
    for row in bench.table_rows(rows):
        table.add_row(*row)
    Console(width=200).print(table)
    typer.echo(f"curves: {plot}")


@bench_app.command("machine")
def bench_machine(
    config: str = typer.Option("configs/quickstart.yaml", "--config", help="The run config whose shapes are measured."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="More key=value settings of that config."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the profile here (YAML) as well as printing it."),
    calibrate_run: Optional[str] = typer.Option(None, "--calibrate-run",
                                                help="A finished run of this config: measure the run's work around "
                                                     "the learner's step on it (never checked against it then)."),
    profile_in: Optional[Path] = typer.Option(None, "--profile", help="With --calibrate-run: calibrate this "
                                              "profile instead of measuring a new one."),
) -> None:
    """This machine's profile for a run config: decode and learner-step seconds, alone and while the config's
    actors decode, the prompt's tokens, loading: what `echo2 plan --from-run --machine` predicts a local run with."""
    import yaml

    from echo2.bench.machine import measure_machine
    from echo2.config import load_config
    from echo2.fleet.planner.run_check import calibrate

    if profile_in is not None and calibrate_run is None:
        fail("--profile is calibrated by --calibrate-run RUN: give both")
    quiet_transformers()
    try:
        if profile_in is not None:
            profile = yaml.safe_load(profile_in.read_text())
        else:
            profile = measure_machine(load_config(config, list(set_ or [])),
                                      progress=lambda line: typer.echo(line, err=True))
        if calibrate_run is not None:
            profile = calibrate(profile, calibrate_run)
    except (OSError, yaml.YAMLError, Echo2InputError) as exc:
        fail(str(exc))
    text = yaml.safe_dump(profile, sort_keys=False)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    typer.echo(text)
