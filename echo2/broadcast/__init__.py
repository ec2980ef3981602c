"""Dissemination plane: relay broadcast of policy versions (store-only fetch until the relay lands)."""
