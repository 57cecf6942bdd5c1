"""A run's sampler: the --scheduler choice and its checkpoint's scheduler config, honoured
or refused, never silently changed.

Two engines run the samplers:
- ``flax``: diffusers' Flax scheduler class (``ddim``, ``pndm``, ``euler``, ``dpmpp``),
  when the checkpoint's config asks only for what that class does;
- ``steps``: promptmill's own pure-JAX steps (``pipeline.model.sampling.steps``, ``stepping``: ``ddim``,
  ``euler``, ``euler_a``, ``lcm``), which follow diffusers' PyTorch schedulers, for what
  the Flax classes lack: trailing or linspace spacing for DDIM, trailing spacing, Karras
  or exponential sigmas for Euler, zero-SNR betas, Euler ancestral and LCM.
Anything neither engine does is refused, naming the key and its value
(``resolve_sampler``), at plan time and again on every host.
"""
from __future__ import annotations

import dataclasses
import os

from pipeline.core.choices import FLOW_SCHEDULERS, SCHEDULERS, TIMESTEP_SPACINGS
from pipeline.model.sampling import steps
from pipeline.model.loading.checkpoint import ModelError, read_json_file

# checkpoint scheduler class names (with or without the Flax prefix) -> --scheduler choice
CHECKPOINT_SCHEDULERS = {"DDIMScheduler": "ddim", "PNDMScheduler": "pndm", "EulerDiscreteScheduler": "euler",
                         "DPMSolverMultistepScheduler": "dpmpp", "EulerAncestralDiscreteScheduler": "euler_a",
                         "LCMScheduler": "lcm"}

# Scheduler-config keys that change sampling in diffusers' PyTorch scheduler of each
# sampler, with the values its Flax class honours. The Flax classes lack these keys and
# ``from_config`` drops them without a word, so a config asking for another value runs on
# the ``steps`` engine, or is refused. A missing key means the PyTorch class's default,
# which every Flax class honours.
HONOURED_CONFIG = {
    "ddim": {"timestep_spacing": ("leading",), "rescale_betas_zero_snr": (False,), "thresholding": (False,)},
    "pndm": {"timestep_spacing": ("leading",), "prediction_type": ("epsilon", "v_prediction")},
    "euler": {"timestep_spacing": ("linspace", "leading"), "prediction_type": ("epsilon", "v_prediction"),
              "use_karras_sigmas": (False,), "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,),
              "final_sigmas_type": ("zero",), "interpolation_type": ("linear",), "timestep_type": ("discrete",),
              "rescale_betas_zero_snr": (False,)},
    "dpmpp": {"algorithm_type": ("dpmsolver++",), "solver_order": (2,), "use_karras_sigmas": (False,),
              "use_lu_lambdas": (False,), "use_exponential_sigmas": (False,), "use_beta_sigmas": (False,),
              "final_sigmas_type": ("zero",), "euler_at_final": (False,), "variance_type": (None,),
              "lambda_min_clipped": (float("-inf"),), "rescale_betas_zero_snr": (False,)},
}


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A run's resolved sampler: the choice, the scheduler config it runs with (the
    checkpoint's, with --timestep-spacing applied) and the engine that runs it."""
    choice: str
    config: dict
    engine: str  # "flax" | "steps"

    @property
    def stochastic(self) -> bool:
        return self.choice in steps.STOCHASTIC


def read_scheduler_config(directory: str) -> dict:
    return read_json_file(os.path.join(directory, "scheduler", "scheduler_config.json"))


def checkpoint_scheduler(directory: str) -> str:
    """The --scheduler choice that a checkpoint's own scheduler config names."""
    class_name = read_scheduler_config(directory).get("_class_name", "")
    choice = CHECKPOINT_SCHEDULERS.get(class_name.removeprefix("Flax"))
    if choice is None:
        raise ModelError(f"{directory}: the checkpoint's scheduler {class_name!r} is not supported; pick one with "
                         f"--scheduler {'|'.join(SCHEDULERS)}")
    return choice


def unhonoured(config: dict, choice: str, overridden: tuple[str, ...] = ()) -> list[tuple[str, object, tuple]]:
    """(key, value, the values the Flax class honours) for each key of a scheduler config
    that the ``choice`` sampler's Flax class would not honour (pure); every key for a
    sampler diffusers has no Flax class of. A config written by a Flax class holds Flax
    keys with Flax semantics, so only the ``overridden`` keys (set by flags) are checked."""
    if choice not in HONOURED_CONFIG:
        return [("_class_name", choice, tuple(HONOURED_CONFIG))]
    flax_written = config.get("_class_name", "").startswith("Flax")
    problems = [(key, config[key], honoured) for key, honoured in HONOURED_CONFIG[choice].items()
                if key in config and config[key] not in honoured and (not flax_written or key in overridden)]
    if choice == "euler" and not flax_written and config.get("timestep_spacing", "linspace") == "leading" \
            and config.get("steps_offset", 0) != 1:  # Flax Euler's leading spacing adds 1, PyTorch's steps_offset
        problems.append(("steps_offset", config.get("steps_offset", 0), (1,)))
    return problems


def resolve_sampler(directory: str, choice: str | None, timestep_spacing: str | None = None,
                    num_steps: int | None = None) -> Sampler:
    """The sampler a run with ``--scheduler choice`` (None: the checkpoint's own) and
    ``--timestep-spacing`` (None: the checkpoint's own) runs; ModelError naming each
    key and value of the resulting scheduler config that no engine would honour, or a
    step count the sampler cannot run (``num_steps``, when given)."""
    choice = choice or checkpoint_scheduler(directory)
    if choice not in SCHEDULERS:
        raise ModelError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {choice!r}")
    if choice in FLOW_SCHEDULERS:
        raise ModelError(f"--scheduler {choice} is the rectified-flow sampler of FLUX.1; {directory} is a diffusion "
                         f"model (SD, SDXL): use one of {', '.join(c for c in SCHEDULERS if c not in FLOW_SCHEDULERS)}")
    config = read_scheduler_config(directory)
    overridden: tuple[str, ...] = ()
    if timestep_spacing is not None:
        if timestep_spacing not in TIMESTEP_SPACINGS:
            raise ModelError(f"--timestep-spacing must be one of {', '.join(TIMESTEP_SPACINGS)}, "
                             f"got {timestep_spacing!r}")
        config, overridden = {**config, "timestep_spacing": timestep_spacing}, ("timestep_spacing",)
    flax_problems = unhonoured(config, choice, overridden)
    if choice in HONOURED_CONFIG and not flax_problems:
        sampler = Sampler(choice, config, "flax")
        _check_steps(directory, sampler, num_steps)
        return sampler
    if choice in steps.SAMPLERS:
        refused = steps.unsupported(_steps_view(config), choice)
        if not refused:
            sampler = Sampler(choice, _steps_view(config), "steps")
            _check_steps(directory, sampler, num_steps)
            if num_steps is not None:
                try:
                    steps.make_schedule(sampler.config, choice, num_steps)
                except ValueError as e:
                    raise ModelError(f"{directory}: {e}") from e
            return sampler
        asked = "; ".join(f"{key}={value!r}" for key, value in refused)
    else:
        asked = "; ".join(f"{key}={value!r} (the {choice} sampler runs {' or '.join(map(repr, honoured))})"
                          for key, value, honoured in flax_problems)
    source = "scheduler/scheduler_config.json" + (" with --timestep-spacing" if overridden else "")
    raise ModelError(f"{directory}: {source} asks for {asked}, which the {choice} sampler does not do; promptmill "
                     f"would not sample as asked, so it refuses: pick another --scheduler or --timestep-spacing, "
                     f"or edit the checkpoint's scheduler config")


def step_range(sampler: Sampler) -> tuple[int, int, str]:
    """(fewest, most) steps ``sampler`` runs correctly, and why. Past the training
    schedule's timesteps the samplers repeat timesteps (diffusers' FlaxDDIMScheduler at
    1001 steps of 1000 gives one unique timestep; its DPM-Solver++ repeats one at 1000);
    diffusers' PNDM without ``skip_prk_steps`` starts with Runge-Kutta steps that need 4."""
    train = int(sampler.config.get("num_train_timesteps", 1000))
    low, high = 1, train - 1 if sampler.choice == "dpmpp" else train
    why = f"the {sampler.choice} sampler over the checkpoint's {train} training timesteps"
    if sampler.choice == "pndm" and sampler.engine == "flax" and not sampler.config.get("skip_prk_steps"):
        low, why = 4, why + " (PNDM's Runge-Kutta start, without skip_prk_steps, takes 4 or more)"
    return low, high, why


def _check_steps(directory: str, sampler: Sampler, num_steps: int | None) -> None:
    if num_steps is None:
        return
    low, high, why = step_range(sampler)
    if not low <= num_steps <= high:
        raise ModelError(f"--steps {num_steps}: {directory} runs {low} to {high} steps ({why})")


# Flax classes without a spacing key, and the spacing they run
_FLAX_SPACING = {"FlaxDDIMScheduler": "leading", "FlaxPNDMScheduler": "leading"}


def _steps_view(config: dict) -> dict:
    """The config as the steps engine reads it: a Flax class that has no spacing key
    still has a spacing, written in here (a missing key would mean the PyTorch default)."""
    spacing = _FLAX_SPACING.get(config.get("_class_name", ""))
    return {**config, "timestep_spacing": spacing} if spacing and "timestep_spacing" not in config else dict(config)


def flax_from_config(cls, config: dict):
    """``cls.from_config(config)`` for a diffusers Flax scheduler class and a config without
    private (``_``) keys: the class built from the keys its ``__init__`` takes, every other
    key kept in its ``config`` as diffusers keeps it for compatible classes. Built here
    because diffusers' ``from_config`` first imports every compatible scheduler class to
    list their keys, scipy with the LMS one: most of a second of every host's start-up,
    for keys that the class ignores either way (tests/test_parity.py checks the two agree)."""
    import inspect

    expected = (set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}
                - set(cls.ignore_for_config) - set(getattr(cls, "_flax_internal_args", ())))
    taken = {k: v for k, v in config.items() if k in expected}
    scheduler = cls(**taken)
    scheduler.register_to_config(**{k: v for k, v in config.items() if k not in taken})
    return scheduler


def make_flax_scheduler(sampler: Sampler):
    """(scheduler, state): diffusers' Flax class for a ``flax``-engine sampler, from the
    checkpoint's config (betas, prediction type, offsets kept; only the algorithm
    changes)."""
    import diffusers

    if sampler.engine != "flax":
        raise ValueError(f"the {sampler.choice} sampler runs on the {sampler.engine} engine, not a Flax class")
    class_name, overrides = SCHEDULERS[sampler.choice]
    config = {k: v for k, v in sampler.config.items() if not k.startswith("_")}
    # the class keeps the keys it knows and drops the others (e.g. PNDM's skip_prk_steps
    # when switching to Euler); HONOURED_CONFIG lists the dropped keys that would change
    # sampling, and resolve_sampler sent those elsewhere
    scheduler = flax_from_config(getattr(diffusers, class_name), {**config, **overrides})
    if "steps_offset" not in scheduler.config:
        # Flax DPM-Solver reads config.steps_offset for "leading" spacing but does not
        # accept it as an argument; carry the checkpoint's value over.
        scheduler.register_to_config(steps_offset=config.get("steps_offset", 0))
    return scheduler, scheduler.create_state()

