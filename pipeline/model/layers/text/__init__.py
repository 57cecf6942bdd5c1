"""Text encoders shared by families and scorers: ``clip`` (CLIP-L, OpenCLIP-H and -bigG, as
SD 1.x/2.x, SDXL, FLUX.1 and the CLIP scorer run them). T5 and Qwen3 are in
``pipeline.model.layers`` (``t5``, ``qwen3``)."""
