"""The VAE decode of a sampler, whole or in micro-batches (``--decode-batch``).

At 1024x1024 the decoder, not the denoiser, sets the largest batch a chip holds: SDXL's
VAE decode needs 1.71 GiB beyond its weights on a v5e chip for one image and 6.0 GiB for
two, as its full-resolution convolutions' temporaries grow with the batch. Decoding a
device's batch ``micro_batch`` images at a time (``jax.lax.map`` over chunks: one decode
program, run once a chunk) bounds them by the micro-batch, so the denoiser bounds the
batch. A chunk is decoded as any batch is, image by image, but XLA may fuse and order a
smaller batch's convolutions otherwise, so the float bits, and now and then an image's
pixel level, can differ from the whole batch's: the micro-batch is a recorded setting
of the run (``Settings.decode_batch``), and a run planned before keeps decoding whole.
"""
from __future__ import annotations

from pipeline.core.decode_batch import planned


def whole(decode_fn, latents):
    """``decode_fn(latents)``: the whole batch at once (a family's default decode)."""
    return decode_fn(latents)


def micro_batches(micro_batch: int | str | None, mesh=None):
    """``decode(decode_fn, latents)``, as a family's sampler takes it: ``decode_in_micro_batches``
    with ``micro_batch`` images at a time (None: ``whole``; "auto", of settings not planned:
    ``planned``'s). ``mesh``: the FSDP mesh the batch is split over (every device decodes
    its own share ``micro_batch`` at a time)."""
    micro_batch = planned(micro_batch)
    if micro_batch is None:
        return whole
    return lambda decode_fn, latents: decode_in_micro_batches(decode_fn, latents, micro_batch, mesh=mesh)


def decode_in_micro_batches(decode_fn, latents, micro_batch: int | None, *, mesh=None):
    """``decode_fn`` ([n, ...] latents -> [n, ...] images, row by row) of ``latents`` [N,
    ...], ``micro_batch`` rows at a time (``jax.lax.map`` over the chunks), in order.

    None, or a micro-batch of at least the batch: ``decode_fn(latents)`` itself, so the
    program is the whole-batch one (the same lowered text). A batch that is no multiple of
    the micro-batch is padded with zero latents up to the next one; their images are
    dropped.

    ``mesh`` (an FSDP program, ``pipeline.model.sharding``): N is the D devices' batches
    of B each, split over the mesh. The micro-batch is per device: each step of the map
    decodes ``micro_batch`` of every device's own rows (D x ``micro_batch``, still split
    over the devices), so no row leaves its device and each device's temporaries are those
    of ``micro_batch`` images."""
    import jax
    import jax.numpy as jnp

    groups = 1 if mesh is None else mesh.devices.size
    total, rest = latents.shape[0], tuple(latents.shape[1:])
    if total % groups:
        raise ValueError(f"a batch of {total} does not split over {groups} devices")
    batch = total // groups
    if micro_batch is None or micro_batch >= batch:
        return decode_fn(latents)
    if micro_batch < 1:
        raise ValueError(f"the decode micro-batch must be at least 1, got {micro_batch}")
    chunks = -(-batch // micro_batch)
    padded = chunks * micro_batch
    grouped = latents.reshape((groups, batch) + rest)
    if padded != batch:
        grouped = jnp.pad(grouped, [(0, 0), (0, padded - batch)] + [(0, 0)] * len(rest))
    # [chunks, groups, micro_batch, ...]: the map walks the chunks, each split over the devices
    stacked = grouped.reshape((groups, chunks, micro_batch) + rest).swapaxes(0, 1)
    split = _constrain(mesh)

    def one(chunk):
        images = decode_fn(split(chunk.reshape((groups * micro_batch,) + rest), 0))
        return images.reshape((groups, micro_batch) + tuple(images.shape[1:]))

    images = jax.lax.map(one, split(stacked, 1))  # [chunks, groups, micro_batch, ...]
    out = tuple(images.shape[3:])
    images = images.swapaxes(0, 1).reshape((groups, padded) + out)[:, :batch]
    return split(images.reshape((total,) + out), 0)


def _constrain(mesh):
    """``split(x, axis)``: ``x`` with ``axis`` split over every device of ``mesh`` (as the
    FSDP program splits its batch), the rest whole; as it is without a mesh."""
    if mesh is None:
        return lambda x, axis: x
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from pipeline.model.sharding import DATA, FSDP

    def split(x, axis):
        spec = [None] * x.ndim
        spec[axis] = (DATA, FSDP)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))

    return split
