"""Control plane: how many actors a run needs and of which kind, the actors' lifecycle, and every dollar
(docs/fleet.md).

    sizing/                  how many actors of which kind the live fleet buys: the overlap model (capacity.py),
                             fitted to a run (fit.py, measured.py), cost-aware activation (activation.py, on
                             cover.py's search), choose.py (what both the live fleet and ``echo2 plan`` buy:
                             sizing/__init__.py), ``fleet.actors: auto`` (autosize.py)
    planner/                 ``echo2 plan``, offline: a whole run's fleet, hours and dollars from a workload file
                             (workload_file.py, run_plan.py, run_range.py: P10/P50/P90) and the models under it
                             (step time, dissemination, traffic, decode speed, learner memory, reclaims, a spot
                             learner, run costs), its tables and notes
    prices/                  what offers cost: catalog.py (the dated catalog and worker profiles shipped in
                             ``infra/``), ``base.py`` (``PriceSource``), one source per file (snapshot, aws,
                             skypilot), ``make_price_source`` (``fleet.prices``), table.py (``echo2 prices``)
    backends/                where actors run: ``base.py`` (``FleetBackend``, ``ActorOffer``: an offer as bought
                             in one market), one backend per file (local processes with a reclaim injector;
                             SkyPilot spot clusters across clouds, with skypilot_api.py, its calls into SkyPilot
                             behind ``SkyApi``, and skypilot_trust.py, what an actor VM is given and uploads),
                             offers.py (which offers each backend launches on), reclaims.py (a reclaim or a
                             crash, from the provider's own record), ``make_backend`` (``fleet.backend``)
    providers.py             one table of provider facts: SkyPilot's name, assumed spot reclaim rate, cap per
                             offer, reclaim detector, egress price, each with its source
    manager.py               the fleet manager: desired against actual for every backend (launch, replace,
                             expel, budget), every event with its offer and price in the ledger
    slots.py                 a slot of the fleet: one actor at a time, the crashes that count against it, the
                             slots a resume adopts
    bill/                    every dollar and byte of a run's bill, from its ledger (``echo2 report``): the
                             workers' rows (ledger.py), the learner's sessions and gaps (learner.py), the
                             actors' byte counters and their price (egress.py), the cost report (report.py),
                             its Markdown and chart (render.py)
    credentials.py           scoped, expiring store credentials for one remote actor

The CLI's commands for it (``echo2 plan``, ``echo2 prices``, ``echo2 fleet down``) are in ``echo2/cli/``.
"""
