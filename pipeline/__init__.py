"""promptmill: text prompts to image datasets with Stable Diffusion in JAX/Flax."""

__version__ = "0.1.0"
