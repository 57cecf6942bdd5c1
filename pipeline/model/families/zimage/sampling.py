"""Z-Image's sampling, as diffusers 0.39's ``ZImagePipeline`` does it, in JAX, in one
fixed-shape program per run.

- prompts: each text in the checkpoint's own chat template (one user message, the
  generation prompt, thinking on: ``format_prompt``), tokenised, right-padded with its
  attention mask and cut to ``max_sequence_length`` (default 512);
- text conditioning: the Qwen3 encoder's second-to-last hidden state (transformers'
  ``hidden_states[-2]``: the output of its last layer but one, before the final norm; the
  last layer is neither loaded nor run), each prompt's own tokens only (its length, from
  its mask: the padding is stripped, as the pipeline does);
- latents: [B, C, H/f, W/f] (16 channels for the real VAE), 2x2-patched by the transformer
  channel-fastest (``patching.pack_latents(order="yxc")``);
- schedule: flow-matching Euler over sigmas ``linspace(1, 1/N, N)`` shifted by the
  scheduler config (Turbo: a static shift of 3; FluxPipeline's ``mu`` where the config asks
  for dynamic shifting); the model's timestep is ``(1000 - t) / 1000`` = 1 - sigma, and its
  output is negated before the Euler step;
- guidance (the "zimage" rule, ``zimage.guidance``): with a scale above 0, the transformer
  runs on [negative; positive] and ``pos + g * (pos - neg)``; at 0, the positive
  prediction alone. ``cfg_normalization`` and ``cfg_truncation`` are ZImagePipeline call
  arguments, off by default; promptmill has neither setting, so it runs them off;
- the final latents through FLUX.1's VAE decode (``z / scaling_factor + shift_factor``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.model.families.zimage import presets
from pipeline.model.families import qwen_text
from pipeline.model.sampling import decoding, flow

MAX_SEQUENCE_LENGTH = presets.TOKENIZER_MAX_LENGTH
PATCH_ORDER = "yxc"


FAMILY, THINKING = "Z-Image", True  # the pipeline's enable_thinking


PROMPTS = qwen_text.ChatPrompts(FAMILY, THINKING, MAX_SEQUENCE_LENGTH)
format_prompt, tokenize, truncated = PROMPTS.format_prompt, PROMPTS.tokenize, PROMPTS.truncated


@dataclasses.dataclass(frozen=True)
class ZImageNets:
    """The networks of a Z-Image checkpoint, in one dtype, and its scheduler config."""
    qwen3: Any  # qwen3.Qwen3Config
    transformer: Any  # transformer.ZImageTransformer
    vae: Any  # vae.VaeDecoder
    scheduler_config: dict
    dtype: Any = None
    tokenizer: Any = None  # once the family loads it
    max_sequence_length: int | None = None

    @property
    def hidden_state(self) -> int:
        """The text encoder's hidden state read: transformers' ``hidden_states[-2]``."""
        return self.qwen3.num_hidden_layers - 1

    @property
    def text_layers(self) -> int:
        from pipeline.model.layers.text import qwen3

        return qwen3.layers_for(self.qwen3, (self.hidden_state,))

    @property
    def vae_scale_factor(self) -> int:
        return self.vae.config.scale_factor

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels


def read_nets(directory: str, dtype=None) -> ZImageNets:
    """The networks of the diffusers-format Z-Image checkpoint in ``directory``, from its
    configs alone; ValueError naming a config it would not honour."""
    import jax.numpy as jnp

    from pipeline.model.families.zimage import transformer as zimage
    from pipeline.model.layers import vae

    dtype = jnp.float32 if dtype is None else dtype
    scheduler_config, q_cfg, t_cfg, v_cfg = qwen_text.read_configs(directory, zimage.ZImageConfig)
    if q_cfg.num_hidden_layers < 2:
        raise ValueError(f"{directory}: the text encoder has {q_cfg.num_hidden_layers} layer(s); Z-Image reads its "
                         f"second-to-last hidden state, which needs 2 or more")
    if v_cfg.batch_norm_eps is not None or v_cfg.patch_size != 1:
        raise ValueError(f"{directory}: vae/config.json is not an AutoencoderKL (Z-Image decodes with FLUX.1's VAE)")
    if t_cfg.cap_feat_dim != q_cfg.hidden_size:
        raise ValueError(f"{directory}: transformer cap_feat_dim {t_cfg.cap_feat_dim} is not the text encoder's "
                         f"hidden_size {q_cfg.hidden_size}")
    if t_cfg.in_channels != v_cfg.latent_channels:
        raise ValueError(f"{directory}: transformer in_channels {t_cfg.in_channels} is not the VAE's "
                         f"latent_channels {v_cfg.latent_channels}")
    return ZImageNets(qwen3=q_cfg, transformer=zimage.ZImageTransformer(t_cfg, dtype),
                      vae=vae.VaeDecoder(v_cfg, dtype), scheduler_config=scheduler_config, dtype=dtype)


def caption_states(nets: ZImageNets, text_params, input_ids, attention_mask, unroll: int = 1):
    """([B, L, hidden] the encoder's second-to-last hidden state, int32 [B] each prompt's
    length): the padding is in the states but never read (the transformer takes each
    prompt's first ``length`` rows)."""
    import jax.numpy as jnp

    from pipeline.model.layers.text import qwen3

    (states,) = qwen3.hidden_states(text_params, nets.qwen3, input_ids, attention_mask, indices=(nets.hidden_state,),
                                    dtype=nets.dtype, unroll=unroll)
    return states, jnp.sum(attention_mask, axis=1).astype(jnp.int32)


def make_schedule(config, steps: int, image_seq_len: int) -> flow.FlowSchedule:
    """ZImagePipeline's schedule: sigmas linspace(1, 1/N, N), shifted by the config (its
    ``mu``, where dynamic, FluxPipeline's ``calculate_shift`` of the image's tokens)."""
    return flow.make_schedule(config, steps, image_seq_len)


def model_timesteps(timesteps):
    """float32 [N]: the transformer's timestep of each step, ``(1000 - t) / 1000``."""
    import numpy as np

    t = np.asarray(timesteps, np.float32)
    return ((np.float32(1000) - t) / np.float32(1000)).astype(np.float32)


def sample(nets: ZImageNets, params, input_ids, attention_mask, latents, *, sigmas, timesteps, negative=None,
           scale=None, rule: str = "zimage", unroll: int = 1, decode=decoding.whole):
    """float32 images [B, H, W, 3] in [0, 1] and the final latents [B, C, H/f, W/f] from
    initial latents, as ZImagePipeline makes them, over a schedule given as arrays.
    ``negative`` (ids, mask) and ``scale`` [B]: the guided program (``guidance.combine``
    under ``rule``: ``guidance.rule``)."""
    import jax
    import jax.numpy as jnp

    from pipeline.model.layers import vae
    from pipeline.model.layers.patching import pack_latents, unpack_latents
    from pipeline.model.sampling import guidance

    batch, _, rows, cols = latents.shape
    if negative is not None:
        input_ids = jnp.concatenate([negative[0], input_ids])
        attention_mask = jnp.concatenate([negative[1], attention_mask])
        scale = jnp.asarray(scale, jnp.float32).reshape(batch, 1, 1)
    states, lengths = caption_states(nets, params["text_encoder"], input_ids, attention_mask, unroll)
    sigmas = jnp.asarray(sigmas, jnp.float32)
    t_model = jnp.asarray(model_timesteps(timesteps))

    def step(i, x):
        model_input = x if negative is None else jnp.concatenate([x, x])
        t = jnp.broadcast_to(t_model[i], (model_input.shape[0],))
        out = nets.transformer.apply({"params": params["transformer"]}, model_input, states, lengths, t,
                                     image_rows=rows // 2).astype(jnp.float32)
        if negative is not None:
            out = guidance.rule(rule).combine(out, scale)
        return flow.step(x, -out, sigmas[i], sigmas[i + 1])

    tokens = jax.lax.fori_loop(0, t_model.shape[0], step, pack_latents(latents.astype(jnp.float32), PATCH_ORDER))
    final = unpack_latents(tokens, rows, cols, PATCH_ORDER)
    return decode(lambda z: vae.vae_decode(nets.vae, params["vae"], z, nets.vae.config), final), final


def make_denoise(nets: ZImageNets, steps: int, width: int, height: int, return_latents: bool = False, *,
                 guided: bool = False, rule: str = "zimage", decode=decoding.whole):
    """``denoise(params, input_ids, attention_mask, latents, negative=None, scale=None)``:
    float32 images [B, height, width, 3] in [0, 1] (with ``return_latents``, also the final
    latents), jit-able; latents float32 [B, C, height/f, width/f]. The schedule is made
    here, on the host. ``decode(decode_fn, latents)`` runs the VAE decode
    (``pipeline.model.sampling.decoding``: whole, or in micro-batches)."""
    f = 2 * nets.vae_scale_factor
    if height % f or width % f:
        raise ValueError(f"height and width must be multiples of {f} (twice the VAE's scale factor, for the 2x2 "
                         f"patches), got {width}x{height}")
    rows, cols = height // nets.vae_scale_factor, width // nets.vae_scale_factor
    nets.transformer.config.check_sizes(rows // 2, cols // 2, nets.max_sequence_length or MAX_SEQUENCE_LENGTH)
    schedule = make_schedule(nets.scheduler_config, steps, (rows // 2) * (cols // 2))

    def denoise(params, input_ids, attention_mask, latents, negative=None, scale=None):
        if tuple(latents.shape[1:]) != (nets.latent_channels, rows, cols):
            raise ValueError(f"latents have shape {tuple(latents.shape)}, expected [B, {nets.latent_channels}, "
                             f"{rows}, {cols}] for {width}x{height} images")
        if guided != (negative is not None):
            raise ValueError("the guided program takes the negative prompts and the scales; the other neither")
        images, final = sample(nets, params, input_ids, attention_mask, latents, sigmas=schedule.sigmas,
                               timesteps=schedule.timesteps, negative=negative, scale=scale, rule=rule,
                               decode=decode)
        return (images, final) if return_latents else images

    return denoise
