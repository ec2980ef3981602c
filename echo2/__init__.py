"""echo2: distributed RL post-training with bounded staleness (after ECHO-2, arXiv 2602.02192)."""

__version__ = "0.1.0"
