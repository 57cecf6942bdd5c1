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
  with the negative prompt's embeddings (the empty prompt unless a record gives one), then the
  latents unpacked, un-normalised by the VAE's batch-norm statistics, unpatched and decoded
  (``pipeline.model.layers.vae``).

The loop is the Qwen-text families' (``qwen_text.TextFlow``); ``KleinFlow`` (``FLOW``) says
what is klein's.
"""
from __future__ import annotations

import dataclasses
import os

from pipeline.model.families import qwen_text
from pipeline.model.families.flux2 import presets
from pipeline.model.layers.text import chat
from pipeline.model.loading.checkpoint import read_json_file
from pipeline.model.sampling import flow

MAX_SEQUENCE_LENGTH = presets.TOKENIZER_MAX_LENGTH
HIDDEN_STATES = (9, 18, 27)  # Flux2KleinPipeline's text_encoder_out_layers
PROMPTS = chat.ChatPrompts("FLUX.2 [klein]", thinking=False, most=MAX_SEQUENCE_LENGTH)  # the pipeline's enable_thinking
format_prompt, tokenize, truncated = PROMPTS.format_prompt, PROMPTS.tokenize, PROMPTS.truncated


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flux2Nets(qwen_text.QwenTextNets):
    """The networks of a FLUX.2 [klein] checkpoint (``transformer``: a ``Flux2Transformer``)."""
    distilled: bool = True  # model_index.json's is_distilled: no guidance (else a base model, which guides)

    @property
    def text_layers(self) -> int:
        """The decoder layers the text encoder runs (up to the deepest hidden state read)."""
        from pipeline.model.layers.text import qwen3

        return qwen3.layers_for(self.qwen3, HIDDEN_STATES)


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


class KleinFlow(qwen_text.TextFlow):
    """FLUX.2 [klein]'s part of the loop: latents drawn patched, the stacked hidden states,
    the positions of image and text tokens, the timestep as sigma (``t / 1000``), klein's
    empirical ``mu``; a distilled model has no guided program."""
    prompts, latent_factor, nets_class = PROMPTS, 2, Flux2Nets
    sigmas_note = "FLUX.2's flow-matching sigmas are linspace(1, 1/N, N), shifted by its empirical mu"

    def transformer(self) -> tuple:
        from pipeline.model.families.flux2 import transformer as flux2

        return flux2.NETWORK, flux2.Flux2Config

    def check_configs(self, directory: str, qwen3_config, transformer_config, vae_config) -> dict:
        """Klein's: the text encoder deep enough for ``HIDDEN_STATES``, stacked into the
        transformer's width; the batch-norm VAE, whose latent channels the transformer takes
        2x2-patched; no guidance embedding (FLUX.2 [dev]'s). Its own field: ``distilled``
        (``model_index.json``'s ``is_distilled``)."""
        from pipeline.model.layers.text import qwen3

        q_cfg, t_cfg, v_cfg = qwen3_config, transformer_config, vae_config
        try:
            qwen3.layers_for(q_cfg, HIDDEN_STATES)
        except ValueError as e:
            raise ValueError(f"{directory}: {e}") from None
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
        return {"distilled": distilled}

    def make_schedule(self, config, steps: int, image_tokens: int) -> flow.FlowSchedule:
        return make_schedule(config, steps, image_tokens)

    def text_states(self, nets, text_params, input_ids, attention_mask, unroll: int = 1):
        return stacked_states(nets, text_params, input_ids, attention_mask, unroll)

    def condition(self, nets, text_params, input_ids, attention_mask, grid, *, unroll: int = 1):
        """(the stacked states, the image tokens' position ids, the text tokens')."""
        from pipeline.model.families.flux2 import transformer as flux2

        context = stacked_states(nets, text_params, input_ids, attention_mask, unroll)
        return context, flux2.latent_image_ids(*grid), flux2.text_ids(input_ids.shape[1])

    def model_times(self, timesteps):
        import jax.numpy as jnp

        return jnp.asarray(timesteps, jnp.float32)

    def predict(self, nets, params, x, condition, t, grid):
        context, image_ids, txt_ids = condition
        # Flux2KleinPipeline passes timestep / 1000, in the latents' dtype (float32)
        return nets.transformer.apply({"params": params}, x, context, t / 1000, image_ids, txt_ids)

    def pack(self, latents):
        return pack(latents)

    def unpack(self, tokens, rows: int, cols: int):
        return unpack(tokens, rows, cols)

    def check(self, nets, grid, guided: bool) -> None:
        if guided and nets.distilled:
            raise ValueError("a distilled FLUX.2 [klein] never guides: its program is never the guided one")


FLOW = KleinFlow()
