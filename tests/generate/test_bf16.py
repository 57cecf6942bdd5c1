"""bf16 runs, and its images stay close to fp32's.

Measured on the tiny models (4 steps, 32x32, two images): mean |fp32 - bf16| of about
1.5 pixel levels, 99th percentile 6, maximum 12 (of 255). The bounds below leave room
for other CPUs' rounding.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.generate.generator import Generator
from pipeline.model import load as model_lib
from pipeline.generate.spec import ProgramSpec


# SDXL's bf16 path is exercised end to end in test_e2e (tiny-sdxl, bf16, dpmpp).
@pytest.mark.parametrize("name", ["tiny"])
def test_bf16_images_are_close_to_fp32(model_cache, name):
    images = {}
    for dtype in ("fp32", "bf16"):
        model = model_lib.load(name, dtype=dtype)  # weights as stored; cast on the devices
        generator = Generator(model, ProgramSpec(32, 32, 4, 2), devices=jax.local_devices()[:1])
        leaves = jax.tree_util.tree_leaves(generator.params["unet"])
        assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16 if dtype == "bf16" else jnp.float32)}
        batch = generator.batch(["a lighthouse at dusk", "a red fox"], ["", "blurry"], [7.5, 5.0], [1, 2**40], [0, 3])
        images[dtype] = generator(batch).astype(int)
    diff = np.abs(images["fp32"] - images["bf16"])
    assert diff.max() > 0  # bf16 really ran in bf16
    assert diff.mean() < 4 and np.percentile(diff, 99) <= 16 and diff.max() <= 40
