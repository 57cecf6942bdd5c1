"""The text encoders, together: ``clip`` (CLIP-L, OpenCLIP-H and -bigG, as SD 1.x/2.x, SDXL,
FLUX.1 and the CLIP scorer run them), ``t5`` (the T5 v1.1 encoder, FLUX.1's), ``qwen3`` (the
Qwen3 encoder, FLUX.2 [klein]'s and Z-Image's) and ``chat`` (prompts rendered in a
checkpoint's own chat template, as the Qwen3 families' pipelines feed them)."""
