"""Latent patching: [B, C, H, W] latents to tokens of 2x2 patches and back. The order of a
patch's values is a parameter: FLUX.1 packs them channel-major (``"cyx"``: channel, then
row, then column: diffusers' ``FluxPipeline._pack_latents``), Z-Image channel-fastest
(``"yxc"``: row, column, then channel: ``ZImageTransformer2DModel._patchify_image``)."""
from __future__ import annotations

ORDERS = ("cyx", "yxc")


def _check(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"patch order must be one of {', '.join(ORDERS)}, got {order!r}")


def pack_latents(latents, order: str = "cyx"):
    """[B, C, H, W] latents -> [B, (H/2)(W/2), 4C] tokens, each a 2x2 patch in ``order``,
    the patches row-major. numpy or jax."""
    _check(order)
    batch, channels, height, width = latents.shape
    patches = latents.reshape(batch, channels, height // 2, 2, width // 2, 2)
    patches = patches.transpose((0, 2, 4, 1, 3, 5) if order == "cyx" else (0, 2, 4, 3, 5, 1))
    return patches.reshape(batch, (height // 2) * (width // 2), channels * 4)


def unpack_latents(tokens, height: int, width: int, order: str = "cyx"):
    """``pack_latents``' inverse: [B, (H/2)(W/2), 4C] -> [B, C, H, W], ``height`` and
    ``width`` the latents' (the image's divided by the VAE's scale factor)."""
    _check(order)
    batch, _, features = tokens.shape
    if order == "cyx":
        patches = tokens.reshape(batch, height // 2, width // 2, features // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    else:
        patches = tokens.reshape(batch, height // 2, width // 2, 2, 2, features // 4).transpose(0, 5, 1, 3, 2, 4)
    return patches.reshape(batch, features // 4, height, width)
