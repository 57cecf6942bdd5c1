"""FLUX.1 sampling in pure JAX, as diffusers' ``FluxPipeline.__call__`` computes it: token
ids and initial latents in, images out.

- ``tokenize``: CLIP ids (77, padded to max length, truncated) and T5 ids
  (``max_sequence_length``, padded to it, truncated, ``</s>`` appended), as FluxPipeline
  tokenises a prompt for each encoder.
- ``read_nets`` / ``read_params``: the networks of a diffusers-format FLUX.1 checkpoint
  from its configs (each refused by name where it asks for what they do not do), and
  their weights from its PyTorch safetensors (single or sharded), each array in its
  stored dtype.
- ``make_denoise``: one jit-able function: CLIP's pooled output and T5's last hidden
  state, the initial latents packed 2x2, the flow-matching Euler loop (a
  ``lax.fori_loop``, the schedule made once on the host by ``pipeline.model.sampling.flow``) with
  one transformer call per step (the embedded guidance of [dev]; never classifier-free
  guidance), then the latents unpacked and decoded to float images in [0, 1]; ``sample``
  is its body, over a schedule passed as arrays.

Latents and the flow steps stay in float32 whatever the networks' dtype, as promptmill's
SD sampler keeps them (diffusers' bf16 pipeline rounds its latents to bf16 between
steps); in float32 the images are FluxPipeline's within float rounding.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from pipeline.model.sampling import decoding, flow
from pipeline.model.families.base import TransformerNets
from pipeline.model.loading.checkpoint import read_json_file

MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default T5 length, and the most it allows


def tokenize(clip_tokenizer, t5_tokenizer, prompts, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
    """(clip_ids int32 [B, 77], t5_ids int32 [B, max_sequence_length]) of ``prompts``, as
    FluxPipeline's ``_get_clip_prompt_embeds`` and ``_get_t5_prompt_embeds`` make them:
    padded to the length, cut at it (the special tokens kept). ValueError for a length
    FluxPipeline refuses (above 512) or below 1."""
    if not (isinstance(max_sequence_length, int) and 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH):
        raise ValueError(f"max_sequence_length must be an integer from 1 to {MAX_SEQUENCE_LENGTH}, "
                         f"got {max_sequence_length!r}")
    prompts = list(prompts)
    return clip_tokenizer.ids(prompts), t5_tokenizer.ids(prompts, max_sequence_length)


def truncated(tokenizer, prompts, max_length: int) -> list[bool]:
    """Whether each prompt has more tokens (special tokens included) than ``max_length``,
    so that ``tokenize`` cuts it short."""
    return [count > max_length for count in tokenizer.counts(list(prompts))]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FluxNets(TransformerNets):
    """The networks of a FLUX.1 checkpoint: its two text encoders besides the transformer
    (``transformer.FluxTransformer``) and the VAE; ``tokenizer`` is CLIP's, ``tokenizer_2``
    T5's, both set once the family loads them (``Flux.load``)."""
    clip: Any  # clip.ClipText (its pooled output)
    t5: Any  # t5.T5Encoder
    tokenizer_2: Any = None

    @property
    def guidance_embeds(self) -> bool:
        return self.transformer.config.guidance_embeds

    @property
    def latent_channels(self) -> int:
        return self.vae.config.latent_channels


def _config(directory: str, component: str, name: str = "config.json") -> dict:
    return read_json_file(os.path.join(directory, component, name))


def read_nets(directory: str, dtype=None) -> FluxNets:
    """The networks of the diffusers-format FLUX.1 checkpoint in ``directory``, computing
    in ``dtype`` (default float32), from its configs alone. ValueError naming the
    component, key and value of any config it would not honour (scheduler included)."""
    import jax.numpy as jnp

    from pipeline.model.families.flux import transformer as flux
    from pipeline.model.layers import vae
    from pipeline.model.layers.text import clip, t5

    dtype = jnp.float32 if dtype is None else dtype
    scheduler_config = _config(directory, "scheduler", "scheduler_config.json")
    refused = flow.unsupported(scheduler_config)
    if refused:
        raise ValueError(f"{directory}: scheduler/scheduler_config.json asks for "
                         + "; ".join(f"{k}={v!r}" for k, v in refused) + ", which flow-matching Euler does not do")
    try:
        clip_config = clip.ClipTextConfig.from_dict(_config(directory, "text_encoder"))
        t5_config = t5.T5Config.from_dict(_config(directory, "text_encoder_2"))
        flux_config = flux.FluxConfig.from_dict(_config(directory, "transformer"))
        vae_config = vae.VaeConfig.from_dict(_config(directory, "vae"))
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None
    return FluxNets(clip=clip.ClipText(clip_config, dtype), t5=t5.T5Encoder(t5_config, dtype), transformer=flux.FluxTransformer(flux_config, dtype),
                    vae=vae.VaeDecoder(vae_config, dtype), scheduler_config=scheduler_config)


def read_params(directory: str, nets: FluxNets) -> dict:
    """{"text_encoder", "text_encoder_2", "transformer", "vae"}: each network's params from
    the checkpoint's PyTorch safetensors (a single file or shards with their index),
    memory-mapped and converted by rule, each array in its stored dtype (stacks and
    transposes are the only copies). WeightsError naming any missing, misshapen or
    unknown weight."""
    from pipeline.model.loading import weights
    from pipeline.model.families.flux import transformer as flux
    from pipeline.model.layers import vae
    from pipeline.model.layers.text import clip, t5

    def state(component, library):
        return weights.read_safetensors_weights(os.path.join(directory, component), library)

    where = lambda component: os.path.join(directory, component)  # noqa: E731
    return {
        "text_encoder": clip.from_torch(state("text_encoder", "transformers"), nets.clip.config,
                                        where("text_encoder")),
        "text_encoder_2": t5.NETWORK.from_torch(state("text_encoder_2", "transformers"), nets.t5.config,
                                        where("text_encoder_2")),
        "transformer": flux.NETWORK.from_torch(state("transformer", "diffusers"), nets.transformer.config,
                                       where("transformer")),
        "vae": vae.NETWORK.from_torch(state("vae", "diffusers"), nets.vae.config, where("vae")),
    }


def sample(nets: FluxNets, params, clip_ids, t5_ids, latents, guidance, *, sigmas, timesteps, steps=None,
           decode=decoding.whole):
    """float32 images [B, H, W, 3] in [0, 1] and the final latents [B, C, H/f, W/f]
    (unpacked, before the VAE's scaling and shift) from initial latents [B, C, H/f, W/f],
    as FluxPipeline makes them, over a schedule given as arrays (``flow.FlowSchedule``'s
    ``sigmas`` [S + 1] and ``timesteps`` [S]). ``steps``: how many of them to run
    (default S); it may be traced, for one program over several step counts (the arrays
    then padded to the longest). ``make_denoise`` is this with the schedule made on the
    host; see it for the arguments. ``decode(decode_fn, latents)`` runs the VAE decode
    (``pipeline.model.sampling.decoding``: whole, or in micro-batches)."""
    import jax
    import jax.numpy as jnp

    from pipeline.model.families.flux import transformer as flux
    from pipeline.model.layers import patching, vae

    batch, _, rows, cols = latents.shape
    if nets.guidance_embeds and guidance is None:
        raise ValueError("this FLUX.1 transformer embeds guidance: sampling needs a guidance per image")
    pooled = nets.clip.apply({"params": params["text_encoder"]}, clip_ids).pooled
    context = nets.t5.apply({"params": params["text_encoder_2"]}, t5_ids)
    embedded = guidance.astype(jnp.float32) if nets.guidance_embeds else None
    image_ids, txt_ids = flux.latent_image_ids(rows // 2, cols // 2), flux.text_ids(t5_ids.shape[1])
    sigmas, timesteps = jnp.asarray(sigmas, jnp.float32), jnp.asarray(timesteps, jnp.float32)

    def step(i, x):
        # FluxPipeline passes timestep / 1000, in the latents' dtype (float32)
        t = jnp.broadcast_to(timesteps[i], (batch,)) / 1000
        velocity = nets.transformer.apply({"params": params["transformer"]}, x, context, pooled, t, image_ids, txt_ids,
                                          guidance=embedded)
        return flow.step(x, velocity, sigmas[i], sigmas[i + 1])

    packed = jax.lax.fori_loop(0, timesteps.shape[0] if steps is None else steps, step,
                               patching.pack_latents(latents.astype(jnp.float32)))
    final = patching.unpack_latents(packed, rows, cols)
    return decode(lambda z: vae.vae_decode(nets.vae, params["vae"], z, nets.vae.config), final), final


def make_denoise(nets: FluxNets, steps: int, width: int, height: int, return_latents: bool = False, *,
                 decode=decoding.whole):
    """``denoise(params, clip_ids, t5_ids, latents, guidance=None)``: float32 images
    [B, height, width, 3] in [0, 1], as FluxPipeline makes them from the same prompts and
    initial latents, jit-able.

    - params: ``read_params``' dict (any float dtype: the networks compute in theirs);
    - clip_ids int [B, 77], t5_ids int [B, L] (``tokenize``): L is T5's sequence length;
    - latents float32 [B, C, height/f, width/f]: the initial latents, unpacked (the draw
      FluxPipeline makes before packing them);
    - guidance float32 [B]: each image's embedded guidance (FLUX.1 [dev]); not read by a
      transformer without a guidance embedding ([schnell]).
    With ``return_latents``: (images, the final latents float32 [B, C, height/f,
    width/f], unpacked, before the VAE's scaling and shift).

    The schedule (``flow.make_schedule`` of the checkpoint's scheduler config, for
    (height/2f)(width/2f) image tokens) is made here, on the host, once; the loop is a
    ``lax.fori_loop`` of ``steps`` transformer calls. The transformer's and the VAE's
    attention run through the seam that is active while the function is traced
    (``pipeline.model.layers.attention.use``, entered by the caller, as the SD sampler does),
    else through XLA's."""
    f = nets.vae_scale_factor
    if height % (2 * f) or width % (2 * f):
        raise ValueError(f"height and width must be multiples of {2 * f} (twice the VAE's scale factor, for the 2x2 "
                         f"packing), got {width}x{height}")
    rows, cols = height // f, width // f
    schedule = flow.make_schedule(nets.scheduler_config, steps, (rows // 2) * (cols // 2))

    def denoise(params, clip_ids, t5_ids, latents, guidance=None):
        if tuple(latents.shape[1:]) != (nets.latent_channels, rows, cols):
            raise ValueError(f"latents have shape {tuple(latents.shape)}, expected [B, {nets.latent_channels}, "
                             f"{rows}, {cols}] for {width}x{height} images")
        images, final = sample(nets, params, clip_ids, t5_ids, latents, guidance, sigmas=schedule.sigmas,
                               timesteps=schedule.timesteps, decode=decode)
        return (images, final) if return_latents else images

    return denoise
