"""Rewards: programmatic verifiers (the shapes-world verifier, numpy and JAX)."""
