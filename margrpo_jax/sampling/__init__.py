"""The masked-autoregressive decoder: static mask schedule, CFG, ``lax`` loops and rollout records."""
