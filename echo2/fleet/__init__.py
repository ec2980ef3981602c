"""Control plane: how many actors a run needs and of which kind, the actors' lifecycle, and every dollar
(docs/fleet.md).

    capacity.py, fit.py      the overlap model: the throughput that keeps the learner busy, the smallest
                             staleness, the predicted utilization of a fleet; its inputs fitted from a run
    plan.py, activation.py   the cheapest set of offers whose (expected) rollouts keep the learner busy
                             (``echo2 plan``); autosize.py sizes a running fleet (``fleet.actors: auto``)
    prices.py, offers.py,    the dated price catalog and worker profiles shipped in ``infra/``, the offers a
    measured.py              run may launch on, worker speeds measured by earlier runs
    price_sources/           where offers and prices come from: ``base.py`` (``PriceSource``), one source per
                             file (snapshot, aws, skypilot), ``make_price_source`` (``fleet.prices``)
    backends/                where actors run: ``base.py`` (``FleetBackend``), one backend per file (local
                             processes with a reclaim injector; SkyPilot spot clusters across clouds),
                             ``make_backend`` (``fleet.backend``)
    skypilot_api.py,         the SkyPilot backend's calls into SkyPilot (behind ``SkyApi``, so tests put a
    skypilot_trust.py        double there) and its trust boundary (what an actor VM is given and uploads)
    manager.py               the fleet manager: desired against actual for every backend (launch, replace,
                             expel, budget), every event with its offer and price in the ledger
    costs.py                 every cost figure of a run, from its ledger (``echo2 report``)
    credentials.py           scoped, expiring store credentials for one remote actor
    reclaims.py              a reclaim or a crash, from the provider's own record
    plan_table.py,           ``echo2 plan``'s and ``echo2 prices``'s rich tables
    price_table.py

The CLI's commands for it (``echo2 plan``, ``echo2 prices``, ``echo2 fleet down``) are in ``echo2/cli/``.
"""
