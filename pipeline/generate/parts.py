"""The parts of a sampler step as programs lowered from shapes alone (no weights needed):
the text encoders, one denoiser call (a UNet's or a transformer's) and one VAE decode, at
one device's shapes, as the model's family lowers them (``Family.parts``).

``flops`` costs a lowered part (XLA's cost analysis); ``pipeline.bench`` measures their
memory and speed, and the TPU check (``pipeline.generate.tpu_check``) compiles them for a
TPU chip to learn how the program's memory grows with the batch. ``seam`` is a context
manager factory entered while a part is traced (the attention seam of
``pipeline.model.layers.attention``); by default nothing is entered. ``sharding``: where the
part's inputs live (e.g. one chip of a TPU topology, ``jax.sharding.SingleDeviceSharding``),
default JAX's default device.
"""
from __future__ import annotations

import contextlib

LABELS = ("text_encoder", "denoiser_call", "vae_decode")  # the parts, as reports name them


def parts(model, width: int, height: int, per_device_batch: int, guided: bool, *, seam=contextlib.nullcontext,
          sharding=None, count: bool = False) -> list[tuple[str, tuple[str, ...], object]]:
    """(label, the param components it reads, lowered program) of each part of one step
    (``Family.parts``); labels "text_encoder" (one per encoder), "denoiser", "vae_decode"."""
    return model.family.parts(model, width, height, per_device_batch, guided, seam=seam, sharding=sharding,
                              count=count)


def lowered(model, width: int, height: int, per_device_batch: int, guided: bool, label: str, *,
            seam=contextlib.nullcontext, sharding=None):
    """The lowered program of the part ``label`` ("denoiser" or "vae_decode")."""
    [found] = [program for name, _, program in parts(model, width, height, per_device_batch, guided, seam=seam,
                                                     sharding=sharding) if name == label]
    return found


def flops(lowered) -> float:
    """XLA's flop count of a lowered program.

    The count of the lowered (unoptimised) module is within 0.01% of the compiled one
    for the UNet of SD 1.5 and costs no compilation (0.3 s instead of 6 s on a CPU).
    Backends that cannot cost a lowered module get it compiled first.
    """
    cost = lowered.cost_analysis()
    if not cost or "flops" not in cost:
        cost = lowered.compile().cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0]
    return float(cost["flops"])


def part_flops(model, width: int, height: int, per_device_batch: int, guided: bool = True) -> dict:
    """Flops of each part of one sampler step, on one device, for B = ``per_device_batch``
    (SD's text encoders and UNet at 2B when ``guided``, else at B): {"text_encoder" (all
    encoders), "denoiser_call", "vae_decode"}. The parts are costed with every layer
    counted (``count``) and with XLA's own attention: every attention implementation
    computes the same exact attention, so the work per image is the same (see
    ``pipeline.bench.flops``)."""
    counted = dict.fromkeys(LABELS, 0.0)
    for label, _, program in parts(model, width, height, per_device_batch, guided, count=True):
        counted["denoiser_call" if label == "denoiser" else label] += flops(program)
    return counted


def image_flops(model, width: int, height: int, steps: int, per_device_batch: int = 1, guided: bool = True) -> float:
    """Flops of one image: (text encoders + ``steps`` denoiser calls + VAE decode) / batch."""
    counted = part_flops(model, width, height, per_device_batch, guided)
    return (counted["text_encoder"] + model.family.denoiser_calls(model, steps) * counted["denoiser_call"]
            + counted["vae_decode"]) / per_device_batch
