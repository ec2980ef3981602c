"""How many actors of which kind a run needs: the overlap model (``capacity.py``), fitted to a run (``fit.py``),
and the cheapest fleet that keeps the learner busy (``plan.py`` for ``echo2 plan``, ``activation.py`` for what
the live fleet buys, both on ``cover.py``'s search). See ``echo2/fleet/__init__.py`` for the whole room.
"""
