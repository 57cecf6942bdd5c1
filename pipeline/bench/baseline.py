"""The seed notebook's way to generate images, as the baseline that the bench compares with.

This follows the diffusers JAX/Flax notebook and blog post that promptmill started from
(``/work/shared/seeds``; huggingface.co/blog/stable_diffusion_jax): load
``FlaxStableDiffusionPipeline``, replicate its parameters with
``flax.jax_utils.replicate``, tokenise each batch with ``prepare_inputs``, shard the ids
over the devices, call the pipeline with ``jit=True`` (its module-level pmap) and turn
the result into PIL images with ``numpy_to_pil``. Nothing is tuned: the point is to
measure that recipe as a user would run it, on the same model, devices and batch.
"""
from __future__ import annotations

import numpy as np


class SeedPipeline:
    """The notebook's pipeline on ``devices``, ``per_device_batch`` prompts per device per call."""

    def __init__(self, directory: str, dtype: str, devices):
        import jax
        import jax.numpy as jnp
        from diffusers import FlaxStableDiffusionPipeline
        from flax.jax_utils import replicate

        from pipeline.model.load import DTYPES, quiet_libraries

        quiet_libraries()
        jdtype = getattr(jnp, DTYPES[dtype])
        self.devices = list(devices)
        self.pipeline, params = FlaxStableDiffusionPipeline.from_pretrained(
            directory, safety_checker=None, feature_extractor=None, dtype=jdtype)
        if dtype == "bf16":
            # the notebook loads the checkpoint's bf16 revision: bf16 weights, not only bf16
            # compute; the scheduler state stays as the pipeline made it
            params = {name: tree if name == "scheduler" else jax.tree_util.tree_map(
                lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
                for name, tree in params.items()}
        self.p_params = replicate(params, self.devices)

    def __call__(self, prompts: list[str], steps: int, height: int, width: int, seed: int) -> list:
        """PIL images of ``prompts`` (a multiple of the device count), as the notebook makes them."""
        import jax

        d = len(self.devices)
        prompt_ids = self.pipeline.prepare_inputs(prompts)
        # flax.training.common_utils.shard, for these devices rather than all local ones
        prompt_ids = prompt_ids.reshape((d, -1) + prompt_ids.shape[1:])
        rng = jax.random.split(jax.random.PRNGKey(seed), d)
        images = self.pipeline(prompt_ids, self.p_params, rng, num_inference_steps=steps, height=height,
                               width=width, jit=True).images
        images = np.asarray(images).reshape((-1,) + images.shape[-3:])
        return self.pipeline.numpy_to_pil(images)
