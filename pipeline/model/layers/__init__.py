"""The layers more than one family uses, written once: promptmill's own Flax networks and
their parts (promptmill runs no network of diffusers' or transformers').

- ``attention``: the attention seam (xla, chunked, Pallas, cuDNN), which every network's
  attention goes through;
- ``norms``, ``rotary``, ``embeddings``, ``modulation``, ``mlp``: float32 norms, multi-axis
  rotary embeddings, timestep embeddings, AdaLN modulation, feed-forwards named as
  diffusers names them;
- ``resnet``: convolutions, resnet blocks, up- and downsampling (the VAE's and the UNet's);
- ``patching``: 2x2 latent packing;
- ``text``: the text encoders and what prepares their input: CLIP (CLIP-L, OpenCLIP-H,
  OpenCLIP-bigG), the T5 v1.1 encoder, the Qwen3 encoder and its chat prompts;
- ``vae``: the VAE decode and its config-driven variants (SD's and SDXL's, FLUX.1's
  AutoencoderKL, FLUX.2's batch-norm, 2x2-patch AutoencoderKLFlux2).

They are Flax Linen modules, as are the families' own networks (SD's UNet, the
transformers): one parameter convention (nested
dicts of arrays, ``module.apply({"params": params}, ...)``) for every network, so that
weight conversion, casting, LoRA merging, sharding and the compile cache treat them all
alike. Their parameter names follow diffusers' and transformers' PyTorch modules, so a
checkpoint's weights load by rule (``pipeline.model.loading.convert``), not by a table
per layer; repeated blocks are ``nn.scan``-ned over weights stacked on a leading layer
axis, so compile time does not grow with depth.
"""
