"""Data plane: the object store, the run layout, rollout files, weights and the ledger."""
