"""promptmill: text prompts to image datasets with diffusion models in JAX/Flax."""

__version__ = "0.1.0"
