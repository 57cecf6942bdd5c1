"""Sampler steps on the devices: the traceable, pure half of the samplers whose schedules
``pipeline.model.sampling.schedules`` makes on the host.

``scale_input``, ``step`` and ``advance`` read a ``Schedule`` that ``schedules.make_schedule``
computed on the host; ``i`` (a network call's index) may be the counter of a
``lax.fori_loop``. The multistep samplers (PNDM, DPM-Solver++) keep outputs of earlier
calls in a state (``start``, ``advance``); the others' state is empty. Importing this
module makes a ``Schedule`` a pytree (its arrays leaves, its sampler, prediction type and
clip range static), so it can be passed into ``jit`` as an argument.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pipeline.model.sampling import multistep
from pipeline.model.sampling.schedules import Schedule

jax.tree_util.register_dataclass(
    Schedule,
    data_fields=["timesteps", "sigmas", "alpha_t", "alpha_prev", "c_skip", "c_out", "inject", "init_noise_sigma",
                 "plan"],
    meta_fields=["sampler", "prediction_type", "clip_range"])


def scale_input(schedule: Schedule, i, sample: jax.Array) -> jax.Array:
    """The network's input at step ``i``: ``sample / sqrt(sigma_i^2 + 1)`` for the Euler
    samplers (their latents live at variance sigma^2 + 1), ``sample`` itself otherwise."""
    if schedule.sampler not in ("euler", "euler_a"):
        return sample
    sigma = jnp.asarray(schedule.sigmas)[i]
    return sample / jnp.sqrt(sigma ** 2 + 1)


def _x0_from_alpha(schedule: Schedule, alpha_t, model_output, sample):
    """Predicted clean sample and noise from a variance-preserving prediction."""
    beta_t = 1 - alpha_t
    kind = schedule.prediction_type
    if kind == "epsilon":
        x0 = (sample - jnp.sqrt(beta_t) * model_output) / jnp.sqrt(alpha_t)
        eps = model_output
    elif kind == "v_prediction":  # Salimans & Ho 2022, v = alpha eps - sigma x0
        x0 = jnp.sqrt(alpha_t) * sample - jnp.sqrt(beta_t) * model_output
        eps = jnp.sqrt(alpha_t) * model_output + jnp.sqrt(beta_t) * sample
    elif kind == "sample":
        x0 = model_output
        eps = (sample - jnp.sqrt(alpha_t) * x0) / jnp.sqrt(beta_t)
    else:
        raise ValueError(f"prediction_type {kind!r} is not supported by {schedule.sampler}")
    if schedule.clip_range is not None:
        x0 = jnp.clip(x0, -schedule.clip_range, schedule.clip_range)
    return x0, eps


def _x0_from_sigma(schedule: Schedule, sigma, model_output, sample):
    kind = schedule.prediction_type
    if kind == "epsilon":
        return sample - sigma * model_output
    if kind == "v_prediction":
        return model_output * (-sigma / jnp.sqrt(sigma ** 2 + 1)) + sample / (sigma ** 2 + 1)
    if kind in ("sample", "original_sample") and schedule.sampler == "euler":
        return model_output
    raise ValueError(f"prediction_type {kind!r} is not supported by {schedule.sampler}")


def start(schedule: Schedule, sample: jax.Array) -> tuple:
    """The state a sampler keeps between calls, before the first: PNDM's last 4 outputs
    (oldest first), its kept sample and its Runge-Kutta accumulator; DPM-Solver++'s previous
    x0; nothing for the others."""
    zeros = jnp.zeros(sample.shape, jnp.float32)
    if schedule.sampler == "pndm":
        return jnp.zeros((4,) + sample.shape, jnp.float32), zeros, zeros
    if schedule.sampler == "dpmpp":
        return (zeros,)
    return ()


def _column(schedule: Schedule, columns: tuple[str, ...], i, name: str):
    return jnp.asarray(schedule.plan)[i, columns.index(name)]


def _pndm(schedule: Schedule, i, output, sample, state):
    ets, kept_sample, acc = state
    col = lambda name: _column(schedule, multistep.PNDM_COLUMNS, i, name)  # noqa: E731
    combined = col("w_now") * output + col("w_acc") * acc
    ets = jnp.where(col("append") > 0, jnp.concatenate([ets[1:], output[None]]), ets)
    for k in range(1, 5):
        combined = combined + col(f"w_{k}") * ets[-k]
    acc = col("acc_keep") * acc + col("acc_add") * output
    kept_sample = jnp.where(col("keep_sample") > 0, sample, kept_sample)
    source = jnp.where(col("use_kept_sample") > 0, kept_sample, sample)
    if schedule.prediction_type == "v_prediction":
        alpha = col("alpha_t")
        combined = jnp.sqrt(alpha) * combined + jnp.sqrt(1 - alpha) * source
    return col("sample_coef") * source - col("output_coef") * combined, (ets, kept_sample, acc)


def _dpmpp(schedule: Schedule, i, output, sample, state):
    (previous,) = state
    col = lambda name: _column(schedule, multistep.DPMPP_COLUMNS, i, name)  # noqa: E731
    alpha, sigma = col("alpha_s"), col("sigma_s")
    kind = schedule.prediction_type
    if kind == "epsilon":
        x0 = (sample - sigma * output) / alpha
    elif kind == "v_prediction":
        x0 = alpha * sample - sigma * output
    else:  # "sample"
        x0 = output
    return col("sample_coef") * sample + col("x0_coef") * x0 + col("previous_coef") * previous, (x0,)


def advance(schedule: Schedule, i, model_output: jax.Array, sample: jax.Array, noise: jax.Array | None = None,
            state: tuple = ()) -> tuple[jax.Array, tuple]:
    """(the sample after call ``i`` (float32), the sampler's state after it), given the
    network's output at call ``i`` and the state before it (``start``); ``noise``: see
    ``step``."""
    if schedule.sampler in ("pndm", "dpmpp"):
        if noise is not None:
            raise ValueError(f"the {schedule.sampler} sampler is deterministic and takes no noise")
        kernel = _pndm if schedule.sampler == "pndm" else _dpmpp
        return kernel(schedule, i, model_output.astype(jnp.float32), sample.astype(jnp.float32), state)
    return step(schedule, i, model_output, sample, noise), state


def step(schedule: Schedule, i, model_output: jax.Array, sample: jax.Array, noise: jax.Array | None = None
         ) -> jax.Array:
    """The sample after step ``i`` (float32), given the network's output at step ``i``, for
    the samplers without a state (``advance`` runs every sampler).

    ``noise`` (same shape as ``sample``, unit normal) is required by the stochastic
    samplers and refused by the others. For LCM the result of the last step is the
    denoised sample itself, and its noise is not used.
    """
    if schedule.sampler in ("pndm", "dpmpp"):
        raise ValueError(f"the {schedule.sampler} sampler keeps a state: run it with advance")
    if schedule.stochastic and noise is None:
        raise ValueError(f"the {schedule.sampler} sampler needs the step's noise")
    if not schedule.stochastic and noise is not None:
        raise ValueError(f"the {schedule.sampler} sampler is deterministic and takes no noise")
    model_output = model_output.astype(jnp.float32)
    sample = sample.astype(jnp.float32)
    if schedule.sampler == "ddim":  # Song et al. 2021, eq. 12 with eta = 0
        alpha_prev = jnp.asarray(schedule.alpha_prev)[i]
        x0, eps = _x0_from_alpha(schedule, jnp.asarray(schedule.alpha_t)[i], model_output, sample)
        return jnp.sqrt(alpha_prev) * x0 + jnp.sqrt(1 - alpha_prev) * eps
    if schedule.sampler == "lcm":  # Luo et al. 2023, algorithm 1 (multistep consistency sampling)
        alpha_prev = jnp.asarray(schedule.alpha_prev)[i]
        x0, _ = _x0_from_alpha(schedule, jnp.asarray(schedule.alpha_t)[i], model_output, sample)
        denoised = jnp.asarray(schedule.c_out)[i] * x0 + jnp.asarray(schedule.c_skip)[i] * sample
        renoised = jnp.sqrt(alpha_prev) * denoised + jnp.sqrt(1 - alpha_prev) * noise.astype(jnp.float32)
        return jnp.where(jnp.asarray(schedule.inject)[i] > 0, renoised, denoised)
    sigmas = jnp.asarray(schedule.sigmas)
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    x0 = _x0_from_sigma(schedule, sigma, model_output, sample)
    derivative = (sample - x0) / sigma
    if schedule.sampler == "euler":  # Karras et al. 2022, algorithm 2 without churn
        return sample + derivative * (sigma_next - sigma)
    # ancestral: step down to sigma_down deterministically, then add sigma_up of fresh noise
    sigma_up = jnp.sqrt(sigma_next ** 2 * (sigma ** 2 - sigma_next ** 2) / sigma ** 2)
    sigma_down = jnp.sqrt(sigma_next ** 2 - sigma_up ** 2)
    return sample + derivative * (sigma_down - sigma) + noise.astype(jnp.float32) * sigma_up
