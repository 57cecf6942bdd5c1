"""The seed notebook's way to generate images, as the baseline that the bench compares with.

This follows the diffusers JAX/Flax notebook and blog post that promptmill started from
(``/work/shared/seeds``; huggingface.co/blog/stable_diffusion_jax): load
``FlaxStableDiffusionPipeline``, replicate its parameters with
``flax.jax_utils.replicate``, tokenise each batch with ``prepare_inputs``, shard the ids
over the devices, call the pipeline with ``jit=True`` (its module-level pmap) and turn
the result into PIL images with ``numpy_to_pil``. Nothing is tuned: the point is to
measure that recipe as a user would run it, on the same model, devices and batch.

diffusers removed its Flax pipelines after 0.39, and promptmill does not need diffusers at
all: this baseline alone does, through the ``notebook`` extra
(``pip install 'promptmill[notebook]'``, which pins diffusers 0.39 and the transformers and
jax it runs on). Without it, asking for the baseline is an error saying so.
"""
from __future__ import annotations

import numpy as np


NOTEBOOK_EXTRA = "notebook"


def notebook_pipeline():
    """diffusers' ``FlaxStableDiffusionPipeline``; RuntimeError naming the extra to install
    when diffusers (0.39, the last with Flax) is not there."""
    try:
        import diffusers
        from diffusers import FlaxStableDiffusionPipeline
    except ImportError as e:
        raise RuntimeError(f"the seed notebook's baseline runs diffusers' FlaxStableDiffusionPipeline, which "
                           f"promptmill does not install: pip install 'promptmill[{NOTEBOOK_EXTRA}]' (diffusers "
                           f"0.39, its last release with Flax) to compare with it ({e})") from None
    diffusers.utils.logging.set_verbosity_error()  # its Flax classes warn at every instance
    return FlaxStableDiffusionPipeline


class SeedPipeline:
    """The notebook's pipeline on ``devices``, ``per_device_batch`` prompts per device per call."""

    def __init__(self, directory: str, dtype: str, devices):
        import jax
        import jax.numpy as jnp
        from flax.jax_utils import replicate

        from pipeline.core.choices import DTYPES

        FlaxStableDiffusionPipeline = notebook_pipeline()
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
