"""Jobs dispatched by ``margrpo_jax.main`` on ``config.mode``."""
