"""Control plane: fleet backends (actors' lifecycle) and, later, the capacity model and cost ledger."""
