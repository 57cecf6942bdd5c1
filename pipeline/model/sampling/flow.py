"""Flow-matching Euler, as diffusers' ``FlowMatchEulerDiscreteScheduler`` runs in FluxPipeline.

FluxPipeline (diffusers 0.39) samples with sigmas ``np.linspace(1, 1/N, N)`` for N
steps, shifted by the scheduler: with ``use_dynamic_shifting``, by ``mu``, a linear
function of the image's token count ((H/16)(W/16) for FLUX.1: ``calculate_shift``),
exponentially (``exp(mu) / (exp(mu) + 1/sigma - 1)``) or linearly (``mu / (mu + 1/sigma
- 1)``, ``time_shift_type``); otherwise by the static ``shift`` (``shift * s / (1 +
(shift - 1) s)``). ``shift_terminal`` then stretches the schedule to end there, and a
terminal sigma 0 is appended. The timesteps are the sigmas times
``num_train_timesteps``; FluxPipeline passes the transformer ``timestep / 1000`` (the
sigma, for 1000 training timesteps), and the transformer multiplies it by 1000 again.
A step is ``x + (sigma_next - sigma) * v`` in float32, ``v`` the transformer's velocity.

Two halves, as SD's samplers' (``pipeline.model.sampling.schedules``, ``stepping``):
- ``make_schedule(config, steps, image_seq_len)`` runs once on the host, in numpy, with
  diffusers' own float32 arithmetic (its sigmas to the bit), after ``unsupported`` has
  refused, naming key and value, anything in the config it does not reproduce;
- ``step`` is pure and traceable.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

CLASS_NAME = "FlowMatchEulerDiscreteScheduler"
# FlowMatchEulerDiscreteScheduler's defaults in diffusers 0.39: a key missing from a
# checkpoint's config takes these values, as ``from_config`` gives it
DEFAULTS: dict[str, Any] = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_shift=0.5,
                                max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096, invert_sigmas=False,
                                shift_terminal=None, use_karras_sigmas=False, use_exponential_sigmas=False,
                                use_beta_sigmas=False, time_shift_type="exponential", stochastic_sampling=False)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _off(value) -> bool:  # diffusers tests these keys for truth: None and False both mean off
    return value is None or value is False


# What this module reproduces, per key (a value for which the rule is False is refused).
# FluxPipeline reads base_shift, max_shift and the two sequence lengths to compute mu
# whether or not dynamic shifting is on, so they must be numbers either way.
SUPPORTED = {
    "num_train_timesteps": _positive_int,
    "shift": lambda v: _number(v) and v > 0,
    "use_dynamic_shifting": lambda v: isinstance(v, bool),
    "base_shift": _number,
    "max_shift": _number,
    "base_image_seq_len": _number,
    "max_image_seq_len": _number,
    "shift_terminal": lambda v: v is None or (_number(v) and v < 1),
    "time_shift_type": lambda v: v in ("exponential", "linear"),
    # Mochi's inverted schedule, the sigma conversions (beta needs scipy) and the
    # stochastic variant are not reproduced: refused, not approximated
    "invert_sigmas": _off,
    "use_karras_sigmas": _off,
    "use_exponential_sigmas": _off,
    "use_beta_sigmas": _off,
    "stochastic_sampling": _off,
    # not a key of this class, but FluxPipeline drops its sigmas when a config sets it
    "use_flow_sigmas": _off,
}


def unsupported(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Every (key, value) of a scheduler config that changes FluxPipeline's sampling but
    that this module does not reproduce; empty means the config is fully honoured. Keys
    the class does not have, and ``_``-prefixed metadata other than ``_class_name``, are
    not read by diffusers either."""
    refused = [(key, value) for key, value in config.items() if key in SUPPORTED and not SUPPORTED[key](value)]
    if config.get("_class_name", CLASS_NAME) != CLASS_NAME:
        refused.insert(0, ("_class_name", config["_class_name"]))
    if not refused and resolved_config(config)["base_image_seq_len"] == resolved_config(config)["max_image_seq_len"]:
        refused.append(("max_image_seq_len", config.get("max_image_seq_len")))  # mu divides by their difference
    return refused


def resolved_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` restricted to the class's keys, missing ones at its defaults."""
    return {key: config.get(key, default) for key, default in DEFAULTS.items()}


def calculate_shift(image_seq_len: int, base_seq_len: float = 256, max_seq_len: float = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """FluxPipeline's ``mu``: the shift interpolated linearly in the image's token count,
    ``base_shift`` at ``base_seq_len`` and ``max_shift`` at ``max_seq_len`` (and beyond,
    extrapolated)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


@dataclasses.dataclass(frozen=True)
class FlowSchedule:
    """A run's schedule: ``sigmas`` float32 [steps + 1] (the last 0), ``timesteps``
    float32 [steps] (sigmas times num_train_timesteps), and ``mu`` (FluxPipeline
    computes it even when the config does not shift dynamically)."""
    sigmas: np.ndarray
    timesteps: np.ndarray
    mu: float

    @property
    def steps(self) -> int:
        return len(self.timesteps)


def pipeline_mu(config: Mapping[str, Any], image_seq_len: int, steps: int) -> float:
    """FluxPipeline's ``mu`` of a resolved config (``calculate_shift``): the default ``mu``
    of ``make_schedule``; a family whose pipeline computes another passes its own."""
    return calculate_shift(image_seq_len, config["base_image_seq_len"], config["max_image_seq_len"],
                           config["base_shift"], config["max_shift"])


def make_schedule(config: Mapping[str, Any], steps: int, image_seq_len: int, mu_of=pipeline_mu) -> FlowSchedule:
    """The schedule of ``steps`` steps for an image of ``image_seq_len`` packed tokens, as a
    flow-matching pipeline calls ``set_timesteps(sigmas=np.linspace(1, 1/N, N), mu=mu)``:
    the same float32 arithmetic as diffusers (numpy on the host). ``mu_of(config,
    image_seq_len, steps)``: the pipeline's ``mu`` (default FluxPipeline's,
    ``pipeline_mu``), used where the config has ``use_dynamic_shifting``. ValueError
    naming what ``unsupported`` refuses, or a step count below 1."""
    refused = unsupported(config)
    if refused:
        raise ValueError("flow-matching scheduler config: " + "; ".join(f"{k}={v!r}" for k, v in refused)
                         + " is not supported")
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    cfg = resolved_config(config)
    if cfg["shift_terminal"] and steps == 1:  # diffusers divides by 1 - sigma_last = 0: NaN sigmas
        raise ValueError(f"flow-matching scheduler config: shift_terminal={cfg['shift_terminal']!r} stretches the "
                         f"schedule to end there, which a single step cannot (diffusers' sigmas are NaN): use 2 "
                         f"steps or more")
    mu = mu_of(cfg, image_seq_len, steps)
    one = np.float32(1)
    sigmas = np.linspace(1.0, 1 / steps, steps).astype(np.float32)
    if cfg["use_dynamic_shifting"]:  # diffusers' time_shift(mu, 1.0, sigmas): a power of 1 changes nothing
        weight = np.float32(math.exp(mu) if cfg["time_shift_type"] == "exponential" else mu)
        sigmas = weight / (weight + (one / sigmas - one))
    else:
        shift = cfg["shift"]
        sigmas = np.float32(shift) * sigmas / (one + np.float32(shift - 1) * sigmas)
    if cfg["shift_terminal"]:
        rest = one - sigmas
        sigmas = one - rest / (rest[-1] / np.float32(1 - cfg["shift_terminal"]))
    sigmas = sigmas.astype(np.float32)
    timesteps = (sigmas * np.float32(cfg["num_train_timesteps"])).astype(np.float32)
    return FlowSchedule(sigmas=np.append(sigmas, np.float32(0)), timesteps=timesteps, mu=mu)


def step(sample, velocity, sigma, sigma_next):
    """One Euler step of the flow, ``sample + (sigma_next - sigma) * velocity``, in float32
    (diffusers upcasts the sample and computes dt from its float32 sigmas). Pure; numpy or
    jax, ``sigma`` and ``sigma_next`` scalars or traced values."""
    dt = (sigma_next - sigma)
    return sample.astype(np.float32) + dt * velocity.astype(np.float32)
