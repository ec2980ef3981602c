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

Runs are the real CLI on the tiny model (``harness.py``): real learner, real actor processes, a real
store (local files, or S3 as moto's server speaks it on loopback). ``quick`` shrinks each scenario to
the size ``make test`` runs (``tests/test_chaos.py``); the full sizes are ``make chaos``'s.
"""

from __future__ import annotations

from echo2.chaos.attacks import dishonest_actors, forgeries, fuzzed_rollouts
from echo2.chaos.bad_peers import bad_peers
from echo2.chaos.faults import bad_input, learner_kills, load, reclaims, store_faults
from echo2.chaos.hostile_store import hostile_store

SCENARIOS = {"reclaims": reclaims, "learner-kill": learner_kills, "bad-peers": bad_peers, "forgeries": forgeries,
             "fuzzed-rollouts": fuzzed_rollouts, "store-faults": store_faults, "bad-input": bad_input,
             "dishonest-actors": dishonest_actors, "relay-tls": lambda w, quick=False: dishonest_actors(w, quick, tls=True),
             "hostile-store": hostile_store, "load": load}
"""Every scenario, in the chaos issue's order (``echo2 chaos --scenario NAME`` runs one)."""
