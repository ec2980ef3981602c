"""``echo2``: the command line (``python -m echo2`` too). One module per command or group of commands:

    run.py      echo2 run CONFIG [--set key=value ...] [--resume] [--dry-run] [--json]
                echo2 learner CONFIG [--nproc P] [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT]  (torchrun)
    actor.py    echo2 actor --run STORE/runs/ID --actor-id ID                  (started by the fleet)
    export.py   echo2 export RUN [--step N] DIR [--dtype D] [--adapter-only] [--push-to-hub REPO [--private]]
    hub.py      what export writes beyond the weights: dtype, a LoRA adapter alone, the model card, the upload
    eval.py     echo2 eval MODEL_OR_CHECKPOINT [--task T] [--config C] [--set k=v] [--json]
    report.py   echo2 report RUN; echo2 audit RUN [--json]                     (from the run's ledger)
    chaos.py    echo2 chaos [--scenario S] [--quick]                           (the chaos suite)
    fleet.py    echo2 plan; echo2 prices; echo2 fleet down RUN                 (capacity, prices, clusters)
    bench.py    echo2 bench broadcast|overlap|cost|learner|staleness|gpu-check (benchmarks, the GPU check)
    config.py   echo2 config schema; echo2 config show [CONFIG] [--set k=v]   (the config's schema, resolved)
    common.py   what they share: fail(), the set-up of a process that runs the flow, logging

Bad input (config, model, store) prints one line and exits 2 (``common.fail``). No module here imports Prefect,
the flows or the learner at module level (they are imported inside the commands), so an actor's ``echo2`` never
loads them.
"""

from __future__ import annotations

import os

# Idle OpenMP threads sleep instead of spinning (set before torch loads its OpenMP runtime): on a CPU the learner
# and its local actors share the cores, and a process whose threads spin while they wait takes cycles from the
# other (docs/benchmarks.md measures it); on a GPU nothing heavy runs in OpenMP. A user's own setting stands.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import Optional  # noqa: E402

import typer  # noqa: E402

import echo2  # noqa: E402
from echo2.cli import actor, bench, chaos, config, export, fleet, report, run
from echo2.cli import eval as eval_
from echo2.cli.common import quiet_bars_when_piped

# before any library that draws a bar is imported: the command modules import none at module level
quiet_bars_when_piped()

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="echo2: distributed RL post-training with bounded staleness.")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"echo2 {echo2.__version__}")
        raise typer.Exit()


@app.callback()  # the app's own options; without a docstring, so the app's help stays the text above
def _options(
    version: Optional[bool] = typer.Option(None, "--version", callback=_print_version, is_eager=True,
                                           help="Print echo2's version and exit."),
) -> None:
    pass


app.command("run")(run.run)
app.command("learner")(run.learner)
app.command("actor")(actor.actor)
app.command("export")(export.export)
app.command("eval")(eval_.eval_policy)
app.command("report")(report.report_costs)
app.command("audit")(report.audit)
app.add_typer(bench.bench_app, name="bench")
app.command("chaos")(chaos.chaos)
app.command("plan")(fleet.plan_fleet)
app.command("prices")(fleet.prices_table)
app.add_typer(fleet.fleet_app, name="fleet")
app.add_typer(config.config_app, name="config")


def main() -> None:
    app()
