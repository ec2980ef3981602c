"""Learning plane: GRPO loss, staleness filter, checkpoints, publishing policy versions."""
