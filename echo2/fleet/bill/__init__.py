"""Every dollar and every byte of a run's bill, from its ledger (docs/fleet.md, "Cost report and audit"): one
owner, so the live ``usd_so_far``, the end-of-run report and ``echo2 report`` can never disagree.

    ledger.py                the rows of what ran and what it cost: one billing row per worker life from the
                             fleet's events, the ledger's steps and completions, ``fleet_usd`` (the live figure
                             the fleet's budget reads); arithmetic only
    learner.py               the learner's bill: its sessions and their rows, the gaps between sessions (reclaims,
                             steps lost, the actors' dollars in them), the report's ``learner`` object
    egress.py                bytes out and their price: the actors' byte counters, checked and capped, folded into
                             the ledger by ``fold_counters`` (the one fold every caller uses), priced per actor
    report.py                the cost report: the pieces above in one JSON-ready dict, written with its renderings
                             (``reports/cost.json``, ``cost.md``, ``cost.png``)
    render.py                the report as Markdown and as the PNG chart, apart from the arithmetic

See ``echo2/fleet/__init__.py`` for the whole room.
"""
