"""What ``--decode-batch auto`` is once a run is planned: one rule for the plan, the
sampler and the metadata (``pipeline.model.sampling.decoding`` decodes in micro-batches)."""
from __future__ import annotations

from pipeline.core.settings import AUTO

# one image at a time: the VAE decoder's temporaries then grow with the image, not the batch (SDXL
# at 1024x1024 on a v5e chip: 1.7 GiB beyond its weights for one image, 6.0 GiB for two), so the
# denoiser bounds the per-device batch; one image at 1024x1024 is about 10 TFLOP of decoding,
# enough to fill a chip.
DECODE_BATCH = 1


def planned(decode_batch: int | str | None) -> int | None:
    """The micro-batch a run decodes in once planned: "auto" is ``DECODE_BATCH``; a number,
    or None (the whole batch at once, runs planned before the setting), as it is. For what
    reads settings before planning (the TPU check, ``--per-device-batch auto``): the
    program the plan will make."""
    return DECODE_BATCH if decode_batch == AUTO else decode_batch
