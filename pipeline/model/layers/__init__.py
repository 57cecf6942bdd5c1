"""promptmill's own Flax networks, for models diffusers' and transformers' Flax code lacks
or no longer runs on our jax: FLUX.1's transformer (``flux``), the T5 v1.1 encoder
(``t5``: transformers' Flax T5 calls ``jnp.clip(a_min=...)``, gone from jax), FLUX.1's
16-channel VAE decode (``vae``), and the naming rule that loads their PyTorch weights
(``convert``).

They are Flax Linen modules, like the diffusers and transformers modules the rest of
promptmill runs (the SD/SDXL UNets, the VAE, CLIP): one parameter convention (nested
dicts of arrays, ``module.apply({"params": params}, ...)``) for every network, so that
weight conversion, casting, LoRA merging, sharding and the compile cache treat them all
alike. Their parameter names follow diffusers' and transformers' PyTorch modules, so a
checkpoint's weights load by rule (``convert``), not by a table per layer; their
repeated blocks are ``nn.scan``-ned over weights stacked on a leading layer axis, so
compile time does not grow with depth.
"""
