"""A run's sampler: the --scheduler choice and its checkpoint's scheduler config, honoured
or refused, never silently changed.

Every SD/SDXL sampler runs on promptmill's own pure-JAX steps
(``pipeline.model.sampling.schedules``, ``stepping``: ``ddim``, ``pndm``, ``euler``, ``dpmpp``,
``euler_a``, ``lcm``), which follow diffusers' PyTorch schedulers: a checkpoint's
``scheduler_config.json`` means what it means to the PyTorch class of the chosen sampler
(its keys, that class's defaults for the missing ones). A config written by one of
diffusers' former Flax scheduler classes (``FlaxDDIMScheduler``...) keeps the meaning it
had there (``_steps_view``). Anything the steps do not do is refused, naming the key and
its value (``resolve_sampler``), at plan time and again on every host.
"""
from __future__ import annotations

import dataclasses
import os

from pipeline.core.choices import FLOW_SCHEDULERS, SCHEDULERS, TIMESTEP_SPACINGS
from pipeline.model.sampling import schedules
from pipeline.model.loading.checkpoint import ModelError, read_json_file

# checkpoint scheduler class names (with or without the Flax prefix) -> --scheduler choice
CHECKPOINT_SCHEDULERS = {"DDIMScheduler": "ddim", "PNDMScheduler": "pndm", "EulerDiscreteScheduler": "euler",
                         "DPMSolverMultistepScheduler": "dpmpp", "EulerAncestralDiscreteScheduler": "euler_a",
                         "LCMScheduler": "lcm"}


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A run's resolved sampler: the choice, the scheduler config it runs with (the
    checkpoint's, with --timestep-spacing applied) and the engine that runs it ("steps";
    the rectified-flow families' own: "flow")."""
    choice: str
    config: dict
    engine: str  # "steps" | "flow"

    @property
    def stochastic(self) -> bool:
        return self.choice in schedules.STOCHASTIC


def read_scheduler_config(directory: str) -> dict:
    return read_json_file(os.path.join(directory, "scheduler", "scheduler_config.json"))


def checkpoint_scheduler(directory: str) -> str:
    """The --scheduler choice that a checkpoint's own scheduler config names."""
    class_name = read_scheduler_config(directory).get("_class_name", "")
    choice = CHECKPOINT_SCHEDULERS.get(class_name.removeprefix("Flax"))
    if choice is None:
        raise ModelError(f"{directory}: the checkpoint's scheduler {class_name!r} is not supported; pick one with "
                         f"--scheduler {'|'.join(c for c in SCHEDULERS if c not in FLOW_SCHEDULERS)}")
    return choice


def resolve_sampler(directory: str, choice: str | None, timestep_spacing: str | None = None,
                    num_steps: int | None = None) -> Sampler:
    """The sampler a run with ``--scheduler choice`` (None: the checkpoint's own) and
    ``--timestep-spacing`` (None: the checkpoint's own) runs; ModelError naming each
    key and value of the resulting scheduler config that the steps would not honour, or a
    step count the sampler cannot run (``num_steps``, when given)."""
    choice = choice or checkpoint_scheduler(directory)
    if choice not in SCHEDULERS:
        raise ModelError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {choice!r}")
    if choice in FLOW_SCHEDULERS:
        raise ModelError(f"--scheduler {choice} is the rectified-flow sampler of FLUX.1; {directory} is a diffusion "
                         f"model (SD, SDXL): use one of {', '.join(c for c in SCHEDULERS if c not in FLOW_SCHEDULERS)}")
    config = read_scheduler_config(directory)
    overridden = timestep_spacing is not None
    if overridden:
        if timestep_spacing not in TIMESTEP_SPACINGS:
            raise ModelError(f"--timestep-spacing must be one of {', '.join(TIMESTEP_SPACINGS)}, "
                             f"got {timestep_spacing!r}")
        config = {**config, "timestep_spacing": timestep_spacing}
    config = _steps_view(config)
    refused = schedules.unsupported(config, choice)
    if refused:
        asked = "; ".join(f"{key}={value!r}" for key, value in refused)
        source = "scheduler/scheduler_config.json" + (" with --timestep-spacing" if overridden else "")
        raise ModelError(f"{directory}: {source} asks for {asked}, which the {choice} sampler does not do; "
                         f"promptmill would not sample as asked, so it refuses: pick another --scheduler or "
                         f"--timestep-spacing, or edit the checkpoint's scheduler config")
    sampler = Sampler(choice, config, "steps")
    if num_steps is not None:
        low, high, why = step_range(sampler)
        if not low <= num_steps <= high:
            raise ModelError(f"--steps {num_steps}: {directory} runs {low} to {high} steps ({why})")
        try:
            schedules.make_schedule(sampler.config, choice, num_steps)
        except ValueError as e:
            raise ModelError(f"{directory}: {e}") from e
    return sampler


def step_range(sampler: Sampler) -> tuple[int, int, str]:
    """(fewest, most) steps ``sampler`` runs correctly, and why: past the training
    schedule's timesteps the samplers repeat timesteps; DPM-Solver's spacing takes one
    timestep more than its steps; PNDM without ``skip_prk_steps`` starts with Runge-Kutta
    steps that need 4."""
    train = int(sampler.config.get("num_train_timesteps", 1000))
    low, high = 1, train - 1 if sampler.choice == "dpmpp" else train
    why = f"the {sampler.choice} sampler over the checkpoint's {train} training timesteps"
    if sampler.choice == "pndm" and not sampler.config.get("skip_prk_steps"):
        low, why = 4, why + " (PNDM's Runge-Kutta start, without skip_prk_steps, takes 4 or more)"
    return low, high, why


# The former Flax classes' spacing, where their config has no key for it, and the offset
# Flax Euler's leading spacing always added (PyTorch's adds steps_offset)
_FLAX_SPACING = {"FlaxDDIMScheduler": "leading", "FlaxPNDMScheduler": "leading"}


def _steps_view(config: dict) -> dict:
    """The config as the steps read it, for one written by a Flax class: a class without a
    spacing key still had a spacing; Flax Euler's leading spacing added 1 whatever
    ``steps_offset`` says; Flax DPM-Solver's last step went to timestep 0 (PyTorch's
    ``final_sigmas_type`` "sigma_min")."""
    name = config.get("_class_name", "")
    view = dict(config)
    if name in _FLAX_SPACING and "timestep_spacing" not in view:
        view["timestep_spacing"] = _FLAX_SPACING[name]
    if name == "FlaxEulerDiscreteScheduler" and view.get("timestep_spacing", "linspace") == "leading":
        view["steps_offset"] = 1
    if name == "FlaxDPMSolverMultistepScheduler":
        view.setdefault("final_sigmas_type", "sigma_min")
    return view
