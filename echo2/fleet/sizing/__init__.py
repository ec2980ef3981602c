"""How many actors of which kind the live fleet buys (``fleet.actors: auto``). The chooser of what is bought is
``choose.py``'s ``choose_fleet``: the live fleet and ``echo2 plan`` (``echo2/fleet/planner/``) both buy with it.

    capacity.py              the overlap model: the throughput that keeps the learner busy, the smallest staleness
    fit.py                   its inputs measured from a run (and ``fit_summary``: predicted against measured)
    measured.py              worker speeds earlier runs measured
    cover.py                 the covering search (branch and bound) activation runs on
    activation.py            the cheapest offers whose expected throughput, over-provisioned for each offer's
                             reclaim rate, meets a target
    choose.py                the chooser: activation checked with the capacity model, the target raised until met
    autosize.py              ``fleet.actors: auto``: the fleet sized from the fitted model, bought with the chooser

See ``echo2/fleet/__init__.py`` for the whole room.
"""
