"""FLUX.2 [klein]'s sampling, as diffusers 0.39's ``Flux2KleinPipeline`` does it, in JAX.

- prompts: each text in the checkpoint's own chat template (one user message, the
  generation prompt, thinking off: ``format_prompt``), tokenised, right-padded with its attention mask
  and cut to ``max_sequence_length`` (default 512);
- text conditioning: the Qwen3 text encoder's hidden states 9, 18 and 27 (transformers'
  ``output_hidden_states`` numbering; padded positions included) stacked per token into
  [B, L, 3 * hidden] (``stacked_states``), the transformer's ``joint_attention_dim``;
- latents: drawn 2x2-patched, [B, 4C, H/2f, W/2f] (the VAE's latent channels x 4, the
  transformer's ``in_channels``), packed into tokens [B, (H/2f)(W/2f), 4C] row-major,
  positions (0, row, column, 0); text positions (0, 0, 0, i);
- schedule: flow-matching Euler over sigmas ``linspace(1, 1/N, N)`` shifted by the
  scheduler config, with klein's empirical ``mu`` (``compute_empirical_mu``: of the
  image's token count and N) in place of FluxPipeline's;
- one transformer call per step (timestep = sigma): a distilled model never guides; a base
  model with a guidance scale above 1 runs classifier-free guidance, ``neg + s * (pos - neg)``
  with the negative prompt's embeddings (the empty prompt unless a record gives one), then the latents unpacked, un-normalised by the VAE's batch-norm statistics,
  unpatched and decoded (``pipeline.model.layers.vae``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from pipeline.model.families.flux2 import presets
from pipeline.model.families import qwen_text
from pipeline.model.loading.checkpoint import read_json_file
from pipeline.model.sampling import decoding, flow

MAX_SEQUENCE_LENGTH = presets.TOKENIZER_MAX_LENGTH
HIDDEN_STATES = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """diffusers' FLUX.2 ``compute_empirical_mu``: the shift of ``image_seq_len`` tokens and
    ``num_steps`` steps, interpolated between its fits at 10 and 200 steps."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + m_200 - 200.0 * a)


def klein_mu(config, image_seq_len: int, steps: int) -> float:
    """``flow.make_schedule``'s ``mu_of`` for klein: the empirical mu, whatever the config's
    shift bounds."""
    return compute_empirical_mu(image_seq_len, steps)


def make_schedule(config, steps: int, image_seq_len: int) -> flow.FlowSchedule:
    return flow.make_schedule(config, steps, image_seq_len, mu_of=klein_mu)


FAMILY, THINKING = "FLUX.2 [klein]", False  # the pipeline's enable_thinking


PROMPTS = qwen_text.ChatPrompts(FAMILY, THINKING, MAX_SEQUENCE_LENGTH)
format_prompt, tokenize, truncated = PROMPTS.format_prompt, PROMPTS.tokenize, PROMPTS.truncated


@dataclasses.dataclass(frozen=True)
class Flux2Nets:
    """The networks of a FLUX.2 [klein] checkpoint, in one dtype, and its scheduler config."""
    qwen3: Any  # qwen3.Qwen3Config
    transformer: Any  # transformer.Flux2Transformer
    vae: Any  # vae.VaeDecoder
    scheduler_config: dict
    dtype: Any = None
    tokenizer: Any = None  # once the family loads it
    max_sequence_length: int | None = None
    distilled: bool = True  # model_index.json's is_distilled: no guidance (else a base model, which guides)

    @property
    def text_layers(self) -> int:
        """The decoder layers the text encoder runs (up to the deepest hidden state read)."""
        from pipeline.model.layers.text import qwen3

        return qwen3.layers_for(self.qwen3, HIDDEN_STATES)

    @property
    def vae_scale_factor(self) -> int:
        return self.vae.config.scale_factor

    @property
    def latent_channels(self) -> int:
        """The channels of the patched latents: the transformer's input."""
        return self.transformer.config.in_channels


def read_nets(directory: str, dtype=None) -> Flux2Nets:
    """The networks of the diffusers-format FLUX.2 [klein] checkpoint in ``directory``,
    from its configs alone; ValueError naming a config it would not honour."""
    import jax.numpy as jnp

    from pipeline.model.families.flux2 import transformer as flux2
    from pipeline.model.layers import vae
    from pipeline.model.layers.text import qwen3

    dtype = jnp.float32 if dtype is None else dtype
    scheduler_config, q_cfg, t_cfg, v_cfg = qwen_text.read_configs(
        directory, flux2.Flux2Config, lambda config: qwen3.layers_for(config, HIDDEN_STATES))
    if v_cfg.batch_norm_eps is None:
        raise ValueError(f"{directory}: vae/config.json is not an AutoencoderKLFlux2 (FLUX.2's batch-norm VAE)")
    if t_cfg.guidance_embeds:
        raise ValueError(f"{directory}: transformer/config.json has guidance_embeds: FLUX.2 [klein]'s transformer "
                         f"takes no guidance (FLUX.2 [dev] is not this family's)")
    if t_cfg.joint_attention_dim != len(HIDDEN_STATES) * q_cfg.hidden_size:
        raise ValueError(f"{directory}: transformer joint_attention_dim {t_cfg.joint_attention_dim} is not "
                         f"{len(HIDDEN_STATES)} x the text encoder's hidden_size {q_cfg.hidden_size}")
    if t_cfg.in_channels != 4 * v_cfg.latent_channels:
        raise ValueError(f"{directory}: transformer in_channels {t_cfg.in_channels} is not 4 x the VAE's "
                         f"latent_channels {v_cfg.latent_channels} (2x2-patched latents)")
    distilled = read_json_file(os.path.join(directory, "model_index.json")).get("is_distilled", False)
    if not isinstance(distilled, bool):
        raise ValueError(f"{directory}: model_index.json's is_distilled must be true or false, got {distilled!r}")
    return Flux2Nets(qwen3=q_cfg, transformer=flux2.Flux2Transformer(t_cfg, dtype), vae=vae.VaeDecoder(v_cfg, dtype),
                     scheduler_config=scheduler_config, dtype=dtype, distilled=distilled)


def stacked_states(nets: Flux2Nets, text_params, input_ids, attention_mask, unroll: int = 1):
    """[B, L, 3 * hidden]: the hidden states ``HIDDEN_STATES`` of each token side by side,
    as ``torch.stack(..., dim=1).permute(0, 2, 1, 3).reshape(B, L, 3 * hidden)``.
    ``unroll``: Qwen3's layers per loop step (all of them for a FLOP count: XLA counts a
    loop's body once)."""
    import jax.numpy as jnp

    from pipeline.model.layers.text import qwen3

    states = qwen3.hidden_states(text_params, nets.qwen3, input_ids, attention_mask, indices=HIDDEN_STATES,
                                 dtype=nets.dtype, unroll=unroll)
    batch, length, hidden = states[0].shape
    return jnp.stack(states, axis=2).reshape(batch, length, len(HIDDEN_STATES) * hidden)


def pack(latents):
    """[B, C, h, w] -> [B, h*w, C] tokens, row-major (``_pack_latents``)."""
    batch, channels, rows, cols = latents.shape
    return latents.reshape(batch, channels, rows * cols).transpose(0, 2, 1)


def unpack(tokens, rows: int, cols: int):
    """[B, h*w, C] -> [B, C, h, w]: ``pack``'s inverse (``_unpack_latents_with_ids`` of
    row-major ids)."""
    batch, _, channels = tokens.shape
    return tokens.transpose(0, 2, 1).reshape(batch, channels, rows, cols)


def sample(nets: Flux2Nets, params, input_ids, attention_mask, latents, *, sigmas, timesteps, negative=None,
           scale=None, rule: str = "diffusers", decode=decoding.whole):
    """float32 images [B, H, W, 3] in [0, 1] and the final patched latents [B, 4C, H/2f,
    W/2f] (before the batch-norm un-normalisation) from initial patched latents, as
    Flux2KleinPipeline makes them, over a schedule given as arrays.

    ``negative`` (a base model's classifier-free guidance): (input_ids, attention_mask) of
    each image's negative prompt; the transformer then runs on [negative; positive] (one
    call of 2B rows: a row's result does not depend on the others) and each image's
    prediction is ``guidance.combine(rule, ...)`` with its ``scale`` [B]: ``neg + s * (pos
    - neg)`` above 1, the positive prediction alone (selected) at 1 or below under the
    "diffusers" rule, as the pipeline's ``do_classifier_free_guidance``."""
    import jax
    import jax.numpy as jnp

    from pipeline.model.families.flux2 import transformer as flux2
    from pipeline.model.layers import vae
    from pipeline.model.sampling import guidance

    batch, _, rows, cols = latents.shape
    if negative is not None:
        input_ids = jnp.concatenate([negative[0], input_ids])
        attention_mask = jnp.concatenate([negative[1], attention_mask])
        scale = jnp.asarray(scale, jnp.float32).reshape(batch, 1, 1)
    context = stacked_states(nets, params["text_encoder"], input_ids, attention_mask)
    image_ids, txt_ids = flux2.latent_image_ids(rows, cols), flux2.text_ids(input_ids.shape[1])
    sigmas, timesteps = jnp.asarray(sigmas, jnp.float32), jnp.asarray(timesteps, jnp.float32)

    def step(i, x):
        model_input = x if negative is None else jnp.concatenate([x, x])
        t = jnp.broadcast_to(timesteps[i], (model_input.shape[0],)) / 1000
        velocity = nets.transformer.apply({"params": params["transformer"]}, model_input, context, t, image_ids,
                                          txt_ids).astype(jnp.float32)
        if negative is not None:
            velocity = guidance.rule(rule).combine(velocity, scale)
        return flow.step(x, velocity, sigmas[i], sigmas[i + 1])

    packed = jax.lax.fori_loop(0, timesteps.shape[0], step, pack(latents.astype(jnp.float32)))
    final = unpack(packed, rows, cols)
    return decode(lambda z: vae.vae_decode(nets.vae, params["vae"], z, nets.vae.config), final), final


def make_denoise(nets: Flux2Nets, steps: int, width: int, height: int, return_latents: bool = False, *,
                 guided: bool = False, rule: str = "diffusers", decode=decoding.whole):
    """``denoise(params, input_ids, attention_mask, latents, negative=None, scale=None)``:
    float32 images [B, height, width, 3] in [0, 1] (with ``return_latents``, also the final
    patched latents), jit-able; latents float32 [B, 4C, height/2f, width/2f], the patched
    draw Flux2KleinPipeline makes. ``guided`` (a base model's program): ``negative`` (ids,
    mask) and ``scale`` [B] are read (``sample``). The schedule is made here, on the host,
    for (height/2f)(width/2f) image tokens. ``decode(decode_fn, latents)`` runs the VAE decode
    (``pipeline.model.sampling.decoding``: whole, or in micro-batches)."""
    f = 2 * nets.vae_scale_factor
    if height % f or width % f:
        raise ValueError(f"height and width must be multiples of {f} (twice the VAE's scale factor, for the 2x2 "
                         f"patching), got {width}x{height}")
    if guided and nets.distilled:
        raise ValueError("a distilled FLUX.2 [klein] never guides: its program is never the guided one")
    rows, cols = height // f, width // f
    schedule = make_schedule(nets.scheduler_config, steps, rows * cols)

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
