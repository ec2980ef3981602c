"""The Prefect flows (docs/prefect.md). Only these modules import Prefect, and this package's ``__init__`` imports
nothing, so ``import echo2`` or an actor's ``echo2`` never loads Prefect:

    train.py          the ``echo2-train`` flow: prepare, start the fleet, train, evaluate, reconcile, tear down
    api_server.py     Prefect's temporary API server, started early so it comes up while the learner imports
    observe.py        what the Prefect UI shows: name and tags, progress and metrics artifacts, the cost report
    events.py         notable ledger events also sent as Prefect events (for Automations)
    secret_blocks.py  the run's key and the store's keys from Prefect Secret blocks (``ECHO2_SECRET_BLOCKS``)
"""
