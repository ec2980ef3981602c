"""The chaos scenarios: each injects one kind of trouble into real runs and says what happened.

Every scenario returns one row: ``scenario``, ``injected`` (how many faults were put in), ``detected``
(how many of them the system was seen to catch: a refusal, a quarantine reason or a log line naming the
fault, a replacement, a retry of the failed request, a resume from the last checkpoint; never inferred
from the run having finished), ``lost`` (committed rollout files lost or used twice, by the ledger
audit), ``bad_loaded`` (bad weights an actor loaded: always judged from what the actors did, never
assumed), ``finished`` (the run, or every run, ended normally), ``leaks`` (files holding a secret),
``broken`` (other properties the scenario checks that did not hold), and ``detail``. The suite fails on
any loss, any bad weight loaded, a run that did not finish, a fault not detected, a leak or anything
broken (``runner.failed``).

One scenario per file here (``relay-tls`` is ``dishonest_actors`` over the relay's TLS); what they share is
in ``echo2/chaos/``: ``harness.py`` (runs, processes, audits, leaks), ``rows.py`` (the row and what actors
loaded), ``fuzz.py``, ``liar.py``, ``s3_proxy.py``, ``moto_iam.py`` (the attackers and faulty services). A new
scenario is a file with a ``name(workdir, quick=False) -> dict`` function and a line in ``SCENARIOS``.

Runs are the real CLI on the tiny model (``harness.py``): real learner, real actor processes, a real
store (local files, or S3 as moto's server speaks it on loopback). ``quick`` shrinks each scenario to
the size ``make test`` runs (``tests/e2e/test_chaos.py``); the full sizes are ``make chaos``'s.
"""

from __future__ import annotations

from echo2.chaos.scenarios import (
    bad_input,
    bad_peers,
    dishonest_actors,
    forgeries,
    fuzzed_rollouts,
    hostile_code,
    hostile_store,
    learner_kill,
    learner_reclaim,
    load,
    reclaims,
    slow_peers,
    store_faults,
)

SCENARIOS = {
    "reclaims": reclaims.reclaims,
    "learner-kill": learner_kill.learner_kills,
    "learner-reclaim": learner_reclaim.learner_reclaim,
    "bad-peers": bad_peers.bad_peers,
    "forgeries": forgeries.forgeries,
    "fuzzed-rollouts": fuzzed_rollouts.fuzzed_rollouts,
    "store-faults": store_faults.store_faults,
    "bad-input": bad_input.bad_input,
    "dishonest-actors": dishonest_actors.dishonest_actors,
    "relay-tls": dishonest_actors.relay_tls,
    "hostile-store": hostile_store.hostile_store,
    "hostile-code": hostile_code.hostile_code,
    "slow-peers": slow_peers.slow_peers,
    "load": load.load,
}
"""Every scenario, in the chaos issue's order (``echo2 chaos --scenario NAME`` runs one)."""
