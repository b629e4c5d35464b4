"""Diffusion processes used by the MAR diffusion heads."""
