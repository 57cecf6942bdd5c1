"""The multistep samplers' schedules: PNDM and DPM-Solver++, as diffusers' PyTorch schedulers
define them (``PNDMScheduler``, ``DPMSolverMultistepScheduler`` with ``dpmsolver++`` of order 2).

Both combine the network's outputs of several steps, so their step keeps a state on the
device (``pipeline.model.sampling.stepping``); everything else about a step is known on the
host and laid out here, once, as one row per network call of ``Schedule.plan``:

- PNDM (Liu et al. 2022, "Pseudo Numerical Methods for Diffusion Models on Manifolds"): the
  pseudo linear multistep method (PLMS, Adams-Bashforth weights 1; 3/2, -1/2; 23/12, -16/12,
  5/12; 55/24, -59/24, 37/24, -9/24 over the last outputs), after either PLMS's own start
  (``skip_prk_steps``: its second call is at the first call's timestep, both outputs
  averaged, from the first sample) or the pseudo Runge-Kutta start (3 steps of 4 calls,
  weights 1/6, 1/3, 1/3, 1/6); each step is the transfer of formula (9). N steps make N + 1
  calls with ``skip_prk_steps``, N + 9 without, as diffusers' pipelines run them;
- DPM-Solver++ (Lu et al. 2022, "DPM-Solver++", algorithm 2, the midpoint or Heun variant):
  the data prediction x0 of each call, a first-order step at the start (and at the end,
  where the config asks for it), second-order steps from the last two x0 otherwise.

The coefficients are computed in float32 numpy in the order diffusers' float32 torch
arithmetic computes them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# PNDM's plan columns: the timestep's and the target's alpha_bar, the coefficients of the
# sample and of the combined output in the transfer, the combination's weights (the call's
# own output, the Runge-Kutta accumulator, and the last 4 outputs kept), how the
# accumulator and the kept outputs change, and which sample the transfer starts from
PNDM_COLUMNS = ("alpha_t", "sample_coef", "output_coef", "w_now", "w_acc", "w_1", "w_2", "w_3", "w_4",
                "acc_keep", "acc_add", "append", "use_kept_sample", "keep_sample")
# DPM-Solver++'s: alpha and sigma of the call's sigma (for x0), and the step's coefficients
# of the sample, the call's x0 and the previous call's x0
DPMPP_COLUMNS = ("alpha_s", "sigma_s", "sample_coef", "x0_coef", "previous_coef")
PLMS_WEIGHTS = {1: (1.0,), 2: (1.5, -0.5), 3: (23 / 12, -16 / 12, 5 / 12), 4: (55 / 24, -59 / 24, 37 / 24, -9 / 24)}
RK_WEIGHTS = (1 / 6, 1 / 3, 1 / 3, 1 / 6)


def _transfer(alphas: np.ndarray, final: np.float32, t: int, prev: int) -> tuple:
    """(alpha_t, sample coefficient, output coefficient) of PNDM's formula (9) from ``t`` to ``prev``."""
    a_t = alphas[t]
    a_prev = alphas[prev] if prev >= 0 else final
    b_t, b_prev = np.float32(1) - a_t, np.float32(1) - a_prev
    sample_coef = (a_prev / a_t) ** np.float32(0.5)
    denom = a_t * b_prev ** np.float32(0.5) + (a_t * b_t * a_prev) ** np.float32(0.5)
    return a_t, sample_coef, (a_prev - a_t) / denom


def pndm_timesteps(cfg: Mapping[str, Any], steps: int) -> tuple[np.ndarray, int]:
    """(the timesteps of every network call, how many of them are Runge-Kutta calls)."""
    train = cfg["num_train_timesteps"]
    spacing = cfg["timestep_spacing"]
    if spacing == "linspace":
        base = np.linspace(0, train - 1, steps).round().astype(np.int64)
    elif spacing == "leading":
        base = (np.arange(0, steps) * (train // steps)).round().astype(np.int64) + int(cfg["steps_offset"])
    elif spacing == "trailing":
        base = np.round(np.arange(train, 0, -train / steps))[::-1].astype(np.int64) - 1
    else:
        raise ValueError(f"timestep_spacing {spacing!r} is not supported")
    if len(base) != steps:
        raise ValueError(f"{spacing} spacing with {steps} steps gives {len(base)} timesteps in diffusers; choose "
                         f"another step count")
    if base.max() > train - 1:
        raise ValueError(f"{spacing} spacing with {steps} steps reaches timestep {base.max()}, past the last "
                         f"({train - 1})")
    if cfg["skip_prk_steps"]:
        return np.concatenate([base[:-1], base[-2:-1], base[-1:]])[::-1].copy(), 0
    if steps < 4:
        raise ValueError("PNDM's Runge-Kutta start (skip_prk_steps false) needs 4 steps or more")
    prk = np.array(base[-4:]).repeat(2) + np.tile(np.array([0, train // steps // 2]), 4)
    prk = prk[:-1].repeat(2)[1:-1][::-1]
    return np.concatenate([prk, base[:-3][::-1]]).astype(np.int64), len(prk)


def pndm_plan(cfg: Mapping[str, Any], steps: int, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps int64 [calls], plan float32 [calls, len(PNDM_COLUMNS)]) of PNDM."""
    timesteps, prk = pndm_timesteps(cfg, steps)
    train = cfg["num_train_timesteps"]
    ratio = train // steps
    final = np.float32(1.0) if cfg["set_alpha_to_one"] else alphas[0]
    rows, kept = [], 0  # kept: how many outputs PLMS holds (at most 4)
    for counter, t in enumerate(timesteps):
        row = dict.fromkeys(PNDM_COLUMNS, 0.0)
        t = int(t)
        if counter < prk:  # step_prk
            phase = counter % 4
            prev = t - (0 if counter % 2 else ratio // 2)
            source = int(timesteps[counter // 4 * 4])
            row["acc_keep"], row["acc_add"] = (0.0, 0.0) if phase == 3 else (1.0, RK_WEIGHTS[phase])
            if phase == 3:
                row["w_acc"], row["w_now"] = 1.0, RK_WEIGHTS[3]
            else:
                row["w_now"] = 1.0
            if phase == 0:
                row["append"], row["keep_sample"] = 1.0, 1.0
                kept = min(kept + 1, 4)
            row["use_kept_sample"] = 1.0
            t_used, prev_used = source, prev
        else:  # step_plms
            prev_used, t_used = t - ratio, t
            if counter != 1:
                row["append"] = 1.0
                kept = min(kept + 1, 4)
            else:
                prev_used, t_used = t, t + ratio
            if kept == 1 and counter == 0:
                row["w_1"], row["keep_sample"] = 1.0, 1.0
            elif kept == 1 and counter == 1:
                row["w_now"], row["w_1"], row["use_kept_sample"] = 0.5, 0.5, 1.0
            else:
                for k, weight in enumerate(PLMS_WEIGHTS[kept]):
                    row[f"w_{k + 1}"] = weight
        row["alpha_t"], row["sample_coef"], row["output_coef"] = _transfer(alphas, final, t_used, prev_used)
        rows.append([row[column] for column in PNDM_COLUMNS])
    return timesteps, np.asarray(rows, np.float32)


def dpmpp_timesteps(cfg: Mapping[str, Any], steps: int) -> np.ndarray:
    """The timesteps of DPM-Solver's ``steps`` calls (its own spacing arithmetic)."""
    train = cfg["num_train_timesteps"]
    last = train  # lambda_min_clipped is -inf: no timestep is clipped
    spacing = cfg["timestep_spacing"]
    if spacing == "linspace":
        timesteps = np.linspace(0, last - 1, steps + 1).round()[::-1][:-1].astype(np.int64)
    elif spacing == "leading":
        ratio = last // (steps + 1)
        timesteps = (np.arange(0, steps + 1) * ratio).round()[::-1][:-1].astype(np.int64) + int(cfg["steps_offset"])
    elif spacing == "trailing":
        timesteps = np.arange(last, 0, -train / steps).round().astype(np.int64) - 1
    else:
        raise ValueError(f"timestep_spacing {spacing!r} is not supported")
    if len(timesteps) != steps or timesteps.min() < 0 or timesteps.max() > train - 1:
        raise ValueError(f"{spacing} spacing with {steps} steps gives timesteps {timesteps.tolist()} in diffusers; "
                         f"choose another step count")
    return timesteps


def dpmpp_plan(cfg: Mapping[str, Any], steps: int, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps int64 [steps], plan float32 [steps, len(DPMPP_COLUMNS)]) of DPM-Solver++ of order 2."""
    timesteps = dpmpp_timesteps(cfg, steps)
    train_sigmas = ((np.float32(1) - alphas) / alphas) ** np.float32(0.5)
    sigmas = np.interp(timesteps, np.arange(len(train_sigmas)), train_sigmas)
    last = train_sigmas[0] if cfg["final_sigmas_type"] == "sigma_min" else 0.0
    sigmas = np.concatenate([sigmas, [last]]).astype(np.float32)

    def alpha_sigma(sigma):
        alpha = np.float32(1) / (sigma ** 2 + np.float32(1)) ** np.float32(0.5)
        return alpha, sigma * alpha

    def lam(alpha, sigma):
        with np.errstate(divide="ignore"):  # sigma 0 at the end: lambda +inf, exp(-h) 0
            return np.log(alpha) - np.log(sigma)

    rows = []
    for i in range(steps):
        alpha_s, sigma_s = alpha_sigma(sigmas[i])
        alpha_t, sigma_t = alpha_sigma(sigmas[i + 1])
        h = lam(alpha_t, sigma_t) - lam(alpha_s, sigma_s)
        decay = np.exp(-h) - np.float32(1)
        final = i == steps - 1 and (cfg["euler_at_final"] or (cfg["lower_order_final"] and steps < 15)
                                    or cfg["final_sigmas_type"] == "zero")
        sample_coef, x0_coef, previous_coef = sigma_t / sigma_s, -(alpha_t * decay), np.float32(0)
        if i > 0 and not final:  # second order: D0 = m0, D1 = (m0 - m1) / r0
            alpha_p, sigma_p = alpha_sigma(sigmas[i - 1])
            r0 = (lam(alpha_s, sigma_s) - lam(alpha_p, sigma_p)) / h
            if cfg["solver_type"] == "midpoint":
                d1 = -np.float32(0.5) * (alpha_t * decay)
            else:  # heun
                d1 = alpha_t * (decay / h + np.float32(1))
            x0_coef, previous_coef = x0_coef + d1 / r0, -d1 / r0
        rows.append([alpha_s, sigma_s, sample_coef, x0_coef, previous_coef])
    return timesteps, np.asarray(rows, np.float32)
