"""Sampler schedules: DDIM, PNDM, Euler, DPM-Solver++, Euler ancestral and LCM, as diffusers'
PyTorch schedulers define them.

These functions follow the PyTorch schedulers of diffusers 0.39 (``DDIMScheduler``,
``PNDMScheduler``, ``EulerDiscreteScheduler``, ``DPMSolverMultistepScheduler``,
``EulerAncestralDiscreteScheduler``, ``LCMScheduler``; the multistep ones' tables in
``pipeline.model.sampling.multistep``), and ``tests/model/test_steps.py`` checks them against
fixtures those schedulers wrote.

Two halves:
- ``make_schedule(config, sampler, steps)`` runs once on the host, in numpy, and returns
  a ``Schedule``: the timesteps and every per-step coefficient as arrays of static
  shape. Anything a config asks for that this module does not do is refused here, by
  ``unsupported``, naming the key and its value, so a caller can refuse it at plan time.
- ``scale_input(schedule, i, sample)`` and ``step(schedule, i, model_output, sample,
  noise)`` (``pipeline.model.sampling.stepping``, the device side) are pure and traceable: ``i``
  may be the counter of a ``lax.fori_loop``. The stochastic samplers (``euler_a``,
  ``lcm``) take the noise of step ``i`` as an argument, so the caller decides where it
  comes from (per image, ``fold_in(image_key, i)``).

This half needs numpy alone: planning checks a checkpoint's sampler without importing
JAX. Once ``pipeline.model.sampling.stepping`` is imported, a ``Schedule`` is a pytree whose array
fields are leaves and whose sampler and prediction type are static, so it can be passed
into ``jit`` as an argument.

Host arithmetic mirrors diffusers' own to the bit where that is cheap (float32
``torch.linspace`` and a double-accumulated ``torch.cumprod``), so the timesteps come out
identical, not merely close.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from pipeline.core.choices import TIMESTEP_SPACINGS
from pipeline.model.sampling import multistep

SAMPLERS = ("ddim", "pndm", "euler", "dpmpp", "euler_a", "lcm")
STOCHASTIC = frozenset({"euler_a", "lcm"})  # samplers whose step takes fresh noise
SPACINGS = TIMESTEP_SPACINGS
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")

# The defaults in diffusers 0.39 of the PyTorch scheduler class each sampler reproduces (the
# classes: ``samplers.CHECKPOINT_SCHEDULERS``): a key missing from a checkpoint's config takes
# these values, exactly as ``SchedulerClass.from_config`` would give it.
# --scheduler dpmpp is DPM-Solver++ of order 2, whatever a checkpoint's config says
OVERRIDES = {"dpmpp": {"algorithm_type": "dpmsolver++", "solver_order": 2}}
_COMMON = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
               trained_betas=None, prediction_type="epsilon", steps_offset=0, rescale_betas_zero_snr=False)
_ALPHA_MODELS = dict(clip_sample=True, clip_sample_range=1.0, set_alpha_to_one=True, thresholding=False,
                     dynamic_thresholding_ratio=0.995, sample_max_value=1.0, timestep_spacing="leading")
DEFAULTS: dict[str, dict[str, Any]] = {
    "ddim": {**_COMMON, **_ALPHA_MODELS},
    "pndm": {**_COMMON, "skip_prk_steps": False, "set_alpha_to_one": False, "timestep_spacing": "leading"},
    "dpmpp": {**_COMMON, "solver_order": 2, "thresholding": False, "algorithm_type": "dpmsolver++",
              "solver_type": "midpoint", "lower_order_final": True, "euler_at_final": False,
              "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
              "use_lu_lambdas": False, "use_flow_sigmas": False, "final_sigmas_type": "zero",
              "lambda_min_clipped": float("-inf"), "variance_type": None, "timestep_spacing": "linspace"},
    "euler": {**_COMMON, "interpolation_type": "linear", "use_karras_sigmas": False, "use_exponential_sigmas": False,
              "use_beta_sigmas": False, "sigma_min": None, "sigma_max": None, "timestep_spacing": "linspace",
              "timestep_type": "discrete", "final_sigmas_type": "zero"},
    "euler_a": {**_COMMON, "timestep_spacing": "linspace"},
    "lcm": {**_COMMON, **_ALPHA_MODELS, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
            "original_inference_steps": 50, "clip_sample": False, "timestep_scaling": 10.0},
}


def _any(_value) -> bool:
    return True


def _is(*allowed):
    return lambda value: value in allowed


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_positive(value) -> bool:
    return value is None or (_number(value) and value > 0)


def _betas_given(value) -> bool:
    return value is None or (isinstance(value, (list, tuple)) and len(value) > 0 and all(map(_number, value)))


# What this module honours, per sampler: key -> the values it reproduces. A key the
# PyTorch class itself lacks is ignored there as here, so it is not listed (e.g. PNDM's
# ``skip_prk_steps`` in a config used with Euler). LCM has ``timestep_spacing`` and
# ``steps_offset`` in its config but its timesteps never read them, in diffusers or here.
_COMMON_SUPPORT = dict(num_train_timesteps=_positive_int, beta_start=_number, beta_end=_number,
                       beta_schedule=_is(*BETA_SCHEDULES), trained_betas=_betas_given, steps_offset=_number,
                       rescale_betas_zero_snr=_is(False, True))
_ALPHA_SUPPORT = dict(clip_sample=_is(False, True), clip_sample_range=_number, set_alpha_to_one=_is(False, True),
                      # dynamic thresholding (Imagen's) is for pixel-space models; refused, not approximated
                      thresholding=_is(False), dynamic_thresholding_ratio=_any, sample_max_value=_any)
SUPPORTED = {
    "ddim": {**_COMMON_SUPPORT, **_ALPHA_SUPPORT, "prediction_type": _is("epsilon", "v_prediction", "sample"),
             "timestep_spacing": _is(*SPACINGS)},
    "pndm": {**_COMMON_SUPPORT, "prediction_type": _is("epsilon", "v_prediction"), "timestep_spacing": _is(*SPACINGS),
             "skip_prk_steps": _is(False, True), "set_alpha_to_one": _is(False, True)},
    "dpmpp": {**_COMMON_SUPPORT, "prediction_type": _is("epsilon", "v_prediction", "sample"),
              "timestep_spacing": _is(*SPACINGS), "thresholding": _is(False), "dynamic_thresholding_ratio": _any,
              "sample_max_value": _any, "solver_order": _is(2), "algorithm_type": _is("dpmsolver++"),
              "solver_type": _is("midpoint", "heun"), "lower_order_final": _is(False, True),
              "euler_at_final": _is(False, True), "final_sigmas_type": _is("zero", "sigma_min"),
              # sigma conversions, clipped lambdas, learned variance, zero SNR, flow sigmas: not reproduced
              "use_karras_sigmas": _is(False, None), "use_exponential_sigmas": _is(False, None),
              "use_beta_sigmas": _is(False, None), "use_lu_lambdas": _is(False, None),
              "use_flow_sigmas": _is(False, None), "lambda_min_clipped": _is(float("-inf")),
              "variance_type": _is(None), "rescale_betas_zero_snr": _is(False)},
    "euler": {**_COMMON_SUPPORT, "prediction_type": _is("epsilon", "v_prediction", "sample", "original_sample"),
              "timestep_spacing": _is(*SPACINGS),
              # log_linear gives n + 2 sigmas for n steps in diffusers 0.39; not reproduced
              "interpolation_type": _is("linear"),
              "use_karras_sigmas": _is(False, True, None), "use_exponential_sigmas": _is(False, True, None),
              # beta sigmas need scipy's beta.ppf
              "use_beta_sigmas": _is(False, None),
              "sigma_min": _optional_positive, "sigma_max": _optional_positive,
              "timestep_type": _is("discrete", "continuous"), "final_sigmas_type": _is("zero", "sigma_min")},
    "euler_a": {**_COMMON_SUPPORT, "prediction_type": _is("epsilon", "v_prediction"),
                "timestep_spacing": _is(*SPACINGS)},
    "lcm": {**_COMMON_SUPPORT, **_ALPHA_SUPPORT, "prediction_type": _is("epsilon", "v_prediction", "sample"),
            "original_inference_steps": _positive_int, "timestep_scaling": _number, "timestep_spacing": _any},
}


def unsupported(config: Mapping[str, Any], sampler: str) -> list[tuple[str, Any]]:
    """Every (key, value) of ``config`` that changes sampling with ``sampler`` in diffusers
    but that this module does not reproduce. Empty means the config is fully honoured.

    Keys the PyTorch class does not have, and ``_``-prefixed metadata, are not listed:
    diffusers ignores them too. Combinations are reported under the key that breaks them
    (two of Euler's sigma conversions at once -> ``use_exponential_sigmas``).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    config = {**config, **OVERRIDES.get(sampler, {})}
    rules = SUPPORTED[sampler]
    refused = [(key, value) for key, value in config.items() if key in rules and not rules[key](value)]
    if sampler == "euler" and config.get("use_karras_sigmas") and config.get("use_exponential_sigmas"):
        refused.append(("use_exponential_sigmas", config["use_exponential_sigmas"]))
    return refused


def resolved_config(config: Mapping[str, Any], sampler: str) -> dict[str, Any]:
    """``config`` restricted to the keys ``sampler``'s PyTorch class has, missing ones at
    that class's defaults (what ``from_config`` would build)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    defaults, config = DEFAULTS[sampler], {**config, **OVERRIDES.get(sampler, {})}
    return {key: config.get(key, default) for key, default in defaults.items()}


# ---------------------------------------------------------------------------------------
# Host side: the noise schedule of training


def _linspace_f32(start: float, end: float, n: int) -> np.ndarray:
    """``torch.linspace(start, end, n, dtype=float32)`` to the bit: a float32 step, each
    value rounded once, filled from both ends toward the middle."""
    start32, end32 = np.float32(start), np.float32(end)
    if n == 1:
        return np.array([start32], np.float32)
    step = np.float64((end32 - start32) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    values = np.where(i < n // 2, np.float64(start32) + step * i, np.float64(end32) - step * (n - 1 - i))
    return values.astype(np.float32)


def _cosine_betas(n: int, max_beta: float = 0.999) -> np.ndarray:
    """The squaredcos_cap_v2 schedule (Nichol & Dhariwal 2021, improved DDPM, eq. 17)."""
    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return np.array([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)], np.float32)


def _rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Shift and scale sqrt(alpha_bar) so the last timestep has zero SNR (Lin et al. 2023,
    "Common Diffusion Noise Schedules and Sample Steps are Flawed", algorithm 1)."""
    root = np.sqrt(np.cumprod((1.0 - betas).astype(np.float64)).astype(np.float32))
    first, last = root[0].copy(), root[-1].copy()
    root = (root - last) * (first / (first - last))
    alphas_bar = root ** 2
    alphas = np.concatenate([alphas_bar[:1], alphas_bar[1:] / alphas_bar[:-1]])
    return (1 - alphas).astype(np.float32)


def alphas_cumprod(config: Mapping[str, Any]) -> np.ndarray:
    """alpha_bar_t for t = 0 .. num_train_timesteps - 1, float32, from a resolved config."""
    n = config["num_train_timesteps"]
    if config["trained_betas"] is not None:
        betas = np.asarray(config["trained_betas"], np.float32)
        if betas.shape != (n,):
            raise ValueError(f"trained_betas has {betas.size} values for num_train_timesteps {n}")
    elif config["beta_schedule"] == "linear":
        betas = _linspace_f32(config["beta_start"], config["beta_end"], n)
    elif config["beta_schedule"] == "scaled_linear":  # Stable Diffusion's: linear in sqrt(beta)
        betas = _linspace_f32(config["beta_start"] ** 0.5, config["beta_end"] ** 0.5, n) ** 2
    elif config["beta_schedule"] == "squaredcos_cap_v2":
        betas = _cosine_betas(n)
    else:
        raise ValueError(f"beta_schedule {config['beta_schedule']!r} is not supported")
    if config["rescale_betas_zero_snr"]:
        betas = _rescale_zero_terminal_snr(betas)
    # torch.cumprod on CPU accumulates float32 in double
    return np.cumprod((1.0 - betas).astype(np.float64)).astype(np.float32)


def spaced_timesteps(config: Mapping[str, Any], steps: int) -> np.ndarray:
    """The timesteps of ``steps`` inference steps, descending, as diffusers' float
    expressions give them (float64 here; DDIM rounds them to integers, the Euler
    samplers keep linspace's fractions in float32).

    Trailing spacing (Lin et al. 2023, table 2) starts at num_train_timesteps - 1. For
    some step counts (61, 103, 121, ... of 1000) diffusers' ``np.arange`` with a
    fractional stride yields one timestep more than asked, and that extra last timestep
    is -1, which diffusers then indexes from the end (as t = 999). Such counts are
    refused here rather than reproduced.
    """
    train = config["num_train_timesteps"]
    spacing = config["timestep_spacing"]
    if spacing == "linspace":
        return np.linspace(0, train - 1, steps)[::-1].copy()
    if spacing == "leading":
        ratio = train // steps
        timesteps = (np.arange(0, steps) * ratio).round()[::-1] + config["steps_offset"]
        if timesteps[0] > train - 1:  # diffusers fails on it (DDIM) or feeds the network t = train
            raise ValueError(f"leading spacing with {steps} steps and steps_offset {config['steps_offset']} "
                             f"reaches timestep {timesteps[0]:g}, past the last ({train - 1})")
        return timesteps
    if spacing == "trailing":
        timesteps = np.round(np.arange(train, 0, -train / steps)) - 1
        if len(timesteps) != steps:
            raise ValueError(f"trailing spacing with {steps} steps gives timestep -1 in diffusers "
                             f"(np.arange yields {len(timesteps)} timesteps); choose another step count")
        return timesteps
    raise ValueError(f"timestep_spacing must be one of {', '.join(SPACINGS)}, got {spacing!r}")


# ---------------------------------------------------------------------------------------
# The schedule


@dataclasses.dataclass(frozen=True, eq=False)  # arrays inside: compare fields, not schedules
class Schedule:
    """Everything a sampler's step needs, precomputed for a fixed number of steps.

    ``timesteps[i]`` is what the network sees at call ``i`` (int32 for DDIM, PNDM,
    DPM-Solver++ and LCM, float32 for the Euler samplers); there is one call per step but
    for PNDM (``multistep.pndm_timesteps``). ``plan`` is a multistep sampler's table, one
    row per call (``multistep``; empty otherwise). ``sigmas`` has ``num_steps + 1`` entries for the
    Euler samplers (zeros otherwise). ``alpha_t``/``alpha_prev`` are alpha_bar at the
    step's timestep and at the one it steps to (DDIM, LCM). ``c_skip``/``c_out`` are
    LCM's boundary-condition scalings, and ``inject[i]`` is 1 where LCM re-noises after
    step ``i`` (every step but the last). ``init_noise_sigma`` multiplies unit-normal
    initial latents.
    """
    sampler: str
    prediction_type: str
    clip_range: float | None  # clamp of the predicted x0 (DDIM, LCM clip_sample), or None
    timesteps: np.ndarray
    sigmas: np.ndarray
    alpha_t: np.ndarray
    alpha_prev: np.ndarray
    c_skip: np.ndarray
    c_out: np.ndarray
    inject: np.ndarray
    init_noise_sigma: np.ndarray
    plan: np.ndarray

    @property
    def num_steps(self) -> int:
        """How many network calls the schedule makes (for PNDM, more than its steps)."""
        return int(self.timesteps.shape[0])

    @property
    def stochastic(self) -> bool:
        return self.sampler in STOCHASTIC


def make_schedule(config: Mapping[str, Any], sampler: str, steps: int) -> Schedule:
    """The schedule of ``sampler`` for ``steps`` inference steps under a checkpoint's
    scheduler ``config`` (missing keys at the PyTorch class's defaults).

    Raises ValueError naming the key and value of anything ``unsupported`` reports, and
    for a step count the scheduler cannot run. Host-side numpy only: cheap enough to
    call at plan time to validate.
    """
    refused = unsupported(config, sampler)
    if refused:
        listed = ", ".join(f"{key}={value!r}" for key, value in refused)
        raise ValueError(f"the {sampler} sampler does not support scheduler config {listed}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    cfg = resolved_config(config, sampler)
    if steps > cfg["num_train_timesteps"]:
        raise ValueError(f"steps ({steps}) cannot exceed num_train_timesteps ({cfg['num_train_timesteps']})")
    alphas = alphas_cumprod(cfg)
    build = {"ddim": _ddim, "pndm": _pndm, "euler": _euler, "dpmpp": _dpmpp, "euler_a": _euler, "lcm": _lcm}[sampler]
    return build(cfg, sampler, steps, alphas)


def _filled(sampler, cfg, timesteps, clip_range=None, **arrays) -> Schedule:
    n = len(timesteps)
    zeros = np.zeros(n, np.float32)
    fields = dict(sigmas=np.zeros(n + 1, np.float32), alpha_t=zeros, alpha_prev=zeros, c_skip=zeros, c_out=zeros,
                  inject=zeros, init_noise_sigma=np.float32(1.0), plan=np.zeros((n, 0), np.float32))
    fields.update(arrays)
    return Schedule(sampler=sampler, prediction_type=cfg["prediction_type"], clip_range=clip_range,
                    timesteps=timesteps, **fields)


def _clip_range(cfg) -> float | None:
    return float(cfg["clip_sample_range"]) if cfg["clip_sample"] else None


def _ddim(cfg, sampler, steps, alphas) -> Schedule:
    timesteps = np.round(spaced_timesteps(cfg, steps)).astype(np.int64)
    # DDIM steps back by train // steps whatever the spacing (diffusers' DDIMScheduler.step)
    prev = timesteps - cfg["num_train_timesteps"] // steps
    final = np.float32(1.0) if cfg["set_alpha_to_one"] else alphas[0]
    alpha_prev = np.where(prev >= 0, alphas[np.clip(prev, 0, None)], final).astype(np.float32)
    return _filled(sampler, cfg, timesteps.astype(np.int32), _clip_range(cfg),
                   alpha_t=alphas[timesteps], alpha_prev=alpha_prev)


def _pndm(cfg, sampler, steps, alphas) -> Schedule:
    timesteps, plan = multistep.pndm_plan(cfg, steps, alphas)
    return _filled(sampler, cfg, timesteps.astype(np.int32), plan=plan)


def _dpmpp(cfg, sampler, steps, alphas) -> Schedule:
    timesteps, plan = multistep.dpmpp_plan(cfg, steps, alphas)
    return _filled(sampler, cfg, timesteps.astype(np.int32), plan=plan)


def _lcm(cfg, sampler, steps, alphas) -> Schedule:
    original = cfg["original_inference_steps"]
    train = cfg["num_train_timesteps"]
    if original > train:
        raise ValueError(f"original_inference_steps ({original}) cannot exceed num_train_timesteps ({train})")
    if steps > original:
        raise ValueError(f"the lcm sampler runs at most original_inference_steps ({original}) steps, got {steps}")
    # the distillation schedule: every (train // original)-th timestep, ending at train - 1
    # for the default 1000/50; inference picks evenly spaced entries of it, from the top
    origin = (np.arange(1, original + 1) * (train // original) - 1)[::-1]
    picks = np.floor(np.linspace(0, len(origin), num=steps, endpoint=False)).astype(np.int64)
    timesteps = origin[picks]
    prev = np.concatenate([timesteps[1:], timesteps[-1:]])  # the last step "steps" to itself
    final = np.float32(1.0) if cfg["set_alpha_to_one"] else alphas[0]
    alpha_prev = np.where(prev >= 0, alphas[np.clip(prev, 0, None)], final).astype(np.float32)
    # consistency-model boundary condition (Song et al. 2023, appendix C), sigma_data 0.5,
    # in float32 like diffusers' tensor arithmetic
    scaled = timesteps.astype(np.float32) * np.float32(cfg["timestep_scaling"])
    sigma_data2 = np.float32(0.25)
    c_skip = sigma_data2 / (scaled ** 2 + sigma_data2)
    c_out = scaled / np.sqrt(scaled ** 2 + sigma_data2)
    inject = np.ones(len(timesteps), np.float32)
    inject[-1] = 0.0
    return _filled(sampler, cfg, timesteps.astype(np.int32), _clip_range(cfg), alpha_t=alphas[timesteps],
                   alpha_prev=alpha_prev, c_skip=c_skip.astype(np.float32), c_out=c_out.astype(np.float32),
                   inject=inject)


def _sigma_to_t(sigma: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """The fractional training timestep whose sigma is ``sigma``, interpolating log sigma."""
    log_sigma = np.log(np.maximum(sigma, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    high = low + 1
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[high]), 0, 1)
    return ((1 - w) * low + w * high).reshape(sigma.shape)


def _euler(cfg, sampler, steps, alphas) -> Schedule:
    timesteps = spaced_timesteps(cfg, steps).astype(np.float32)
    if cfg["rescale_betas_zero_snr"]:
        # zero terminal SNR means an infinite last sigma; diffusers caps alpha_bar at 2^-24
        alphas = alphas.copy()
        alphas[-1] = 2.0 ** -24
    train_sigmas = np.sqrt((1 - alphas) / alphas)
    sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
    n = len(timesteps)
    if sampler == "euler" and (cfg["use_karras_sigmas"] or cfg["use_exponential_sigmas"]):
        low = cfg["sigma_min"] if cfg["sigma_min"] is not None else sigmas[-1].item()
        high = cfg["sigma_max"] if cfg["sigma_max"] is not None else sigmas[0].item()
        if cfg["use_karras_sigmas"]:  # Karras et al. 2022, eq. 5, rho = 7
            rho = 7.0
            ramp = np.linspace(0, 1, n)
            sigmas = (high ** (1 / rho) + ramp * (low ** (1 / rho) - high ** (1 / rho))) ** rho
        else:
            sigmas = np.exp(np.linspace(math.log(high), math.log(low), n))
        log_train = np.log(train_sigmas)
        timesteps = np.array([_sigma_to_t(sigma, log_train) for sigma in sigmas]).astype(np.float32)
    if sampler == "euler" and cfg["final_sigmas_type"] == "sigma_min":
        last = np.sqrt((1 - alphas[0]) / alphas[0])
    else:
        last = 0.0
    sigmas = np.concatenate([sigmas, [last]]).astype(np.float32)
    if sampler == "euler" and cfg["timestep_type"] == "continuous" and cfg["prediction_type"] == "v_prediction":
        timesteps = (np.float32(0.25) * np.log(sigmas[:-1])).astype(np.float32)
    peak = sigmas.max()
    # leading spacing never reaches the last training timestep, so the first input is
    # scaled as a variance-preserving sample (sqrt(sigma^2 + 1)), as diffusers does
    init = peak if cfg["timestep_spacing"] in ("linspace", "trailing") else np.sqrt(peak ** 2 + np.float32(1))
    return _filled(sampler, cfg, timesteps, sigmas=sigmas, init_noise_sigma=np.float32(init))
