"""Latent patching: [B, C, H, W] latents to tokens of 2x2 patches and back, as
diffusers' FLUX pipelines pack them (channel-major, then row, then column)."""
from __future__ import annotations


def pack_latents(latents):
    """[B, C, H, W] latents -> [B, (H/2)(W/2), 4C] tokens, each a 2x2 patch (channel-major,
    then row, then column), as diffusers' ``FluxPipeline._pack_latents``. numpy or jax."""
    batch, channels, height, width = latents.shape
    patches = latents.reshape(batch, channels, height // 2, 2, width // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return patches.reshape(batch, (height // 2) * (width // 2), channels * 4)


def unpack_latents(tokens, height: int, width: int):
    """``pack_latents``' inverse: [B, (H/2)(W/2), 4C] -> [B, C, H, W], ``height`` and
    ``width`` the latents' (the image's divided by the VAE's scale factor)."""
    batch, _, features = tokens.shape
    patches = tokens.reshape(batch, height // 2, width // 2, features // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return patches.reshape(batch, features // 4, height, width)
