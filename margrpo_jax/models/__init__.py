"""Model modules (Flax NNX): ViT blocks, the MAR backbone, text encoders and diffusion heads."""
