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

The loop is the Qwen-text families' (``qwen_text.TextFlow``); ``ZImageFlow`` (``FLOW``) says
what is Z-Image's.
"""
from __future__ import annotations

import dataclasses

from pipeline.model.families import qwen_text
from pipeline.model.families.zimage import presets
from pipeline.model.layers.text import chat
from pipeline.model.sampling import flow

MAX_SEQUENCE_LENGTH = presets.TOKENIZER_MAX_LENGTH
PATCH_ORDER = "yxc"
PROMPTS = chat.ChatPrompts("Z-Image", thinking=True, most=MAX_SEQUENCE_LENGTH)  # the pipeline's enable_thinking
format_prompt, tokenize, truncated = PROMPTS.format_prompt, PROMPTS.tokenize, PROMPTS.truncated


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZImageNets(qwen_text.QwenTextNets):
    """The networks of a Z-Image checkpoint (``transformer``: a ``ZImageTransformer``)."""

    @property
    def hidden_state(self) -> int:
        """The text encoder's hidden state read: transformers' ``hidden_states[-2]``."""
        return self.qwen3.num_hidden_layers - 1

    @property
    def text_layers(self) -> int:
        from pipeline.model.layers.text import qwen3

        return qwen3.layers_for(self.qwen3, (self.hidden_state,))


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


class ZImageFlow(qwen_text.TextFlow):
    """Z-Image's part of the loop: latents drawn whole and patched by the transformer
    channel-fastest, each caption's own length, the timestep 1 - sigma, the prediction
    negated into the flow's velocity; sizes and caption lengths its position tables hold."""
    prompts, nets_class = PROMPTS, ZImageNets
    sigmas_note = "Z-Image's flow-matching sigmas are linspace(1, 1/N, N), shifted as its scheduler config says"

    def transformer(self) -> tuple:
        from pipeline.model.families.zimage import transformer as zimage

        return zimage.NETWORK, zimage.ZImageConfig

    def check_configs(self, directory: str, qwen3_config, transformer_config, vae_config) -> dict:
        """Z-Image's: a text encoder of 2 layers or more (its second-to-last hidden state),
        as wide as the transformer's captions; FLUX.1's VAE, whose latent channels the
        transformer takes."""
        q_cfg, t_cfg, v_cfg = qwen3_config, transformer_config, vae_config
        if q_cfg.num_hidden_layers < 2:
            raise ValueError(f"{directory}: the text encoder has {q_cfg.num_hidden_layers} layer(s); Z-Image reads "
                             f"its second-to-last hidden state, which needs 2 or more")
        if v_cfg.batch_norm_eps is not None or v_cfg.patch_size != 1:
            raise ValueError(f"{directory}: vae/config.json is not an AutoencoderKL (Z-Image decodes with FLUX.1's "
                             f"VAE)")
        if t_cfg.cap_feat_dim != q_cfg.hidden_size:
            raise ValueError(f"{directory}: transformer cap_feat_dim {t_cfg.cap_feat_dim} is not the text encoder's "
                             f"hidden_size {q_cfg.hidden_size}")
        if t_cfg.in_channels != v_cfg.latent_channels:
            raise ValueError(f"{directory}: transformer in_channels {t_cfg.in_channels} is not the VAE's "
                             f"latent_channels {v_cfg.latent_channels}")
        return {}

    def text_states(self, nets, text_params, input_ids, attention_mask, unroll: int = 1):
        return caption_states(nets, text_params, input_ids, attention_mask, unroll)

    def model_times(self, timesteps):
        import jax.numpy as jnp

        return jnp.asarray(model_timesteps(timesteps))

    def predict(self, nets, params, x, condition, t, grid):
        states, lengths = condition
        return nets.transformer.apply({"params": params}, x, states, lengths, t, image_rows=grid[0] // 2)

    def velocity(self, prediction):
        return -prediction  # the pipeline negates the transformer's output before the Euler step

    def pack(self, latents):
        from pipeline.model.layers.patching import pack_latents

        return pack_latents(latents, PATCH_ORDER)

    def unpack(self, tokens, rows: int, cols: int):
        from pipeline.model.layers.patching import unpack_latents

        return unpack_latents(tokens, rows, cols, PATCH_ORDER)

    def check(self, nets, grid, guided: bool) -> None:
        rows, cols = grid
        nets.transformer.config.check_sizes(rows // 2, cols // 2, nets.max_sequence_length or MAX_SEQUENCE_LENGTH)


FLOW = ZImageFlow()
