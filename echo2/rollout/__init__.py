"""Rollout plane: inference engines and the actor loop. Never imports Prefect or the learner."""
