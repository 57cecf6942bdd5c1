"""Flow-matching Euler (``pipeline.model.sampling.flow``) against diffusers' ``FlowMatchEulerDiscreteScheduler``.

``tests/fixtures/flux/schedules.npz`` holds the sigmas and timesteps that diffusers' PyTorch
scheduler set, the way FluxPipeline calls it (``sigmas=np.linspace(1, 1/N, N)``, ``mu`` from
the image's token count), for seven configs (FLUX.1 [schnell]'s static shift, [dev]'s dynamic
shifting, a static shift of 3, linear time shifting, ``shift_terminal`` with dynamic and
static shifting, other sequence lengths and shifts), seven token counts and five step
counts, and one run of its ``step``; ``make_flux_fixtures.sh`` made them with torch.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model.sampling import flow
from pipeline.model.families.flux import presets as tiny_flux
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "flux")


@pytest.fixture(scope="module")
def schedules():
    return dict(np.load(os.path.join(FIXTURES, "schedules.npz")))


def test_the_schedule_fixtures_cover_what_they_claim(schedules):
    configs = json.loads(str(schedules["configs"]))
    rows = json.loads(str(schedules["cases"]))
    assert len(rows) == len(configs) * 7 * 5 == schedules["sigmas"].shape[0]
    assert {row[0] for row in rows} == set(configs)
    assert any(c.get("use_dynamic_shifting") for c in configs.values())
    assert {c.get("time_shift_type", "exponential") for c in configs.values()} == {"exponential", "linear"}
    assert sum(bool(c.get("shift_terminal")) for c in configs.values()) == 2


def test_schedules_equal_diffusers(schedules):
    """Every (config, image token count, steps): sigmas (the terminal 0 included) and
    timesteps equal to diffusers', to the bit (the same float32 arithmetic), and mu as
    FluxPipeline computes it."""
    configs = json.loads(str(schedules["configs"]))
    compared = 0
    for i, (name, seq_len, steps) in enumerate(json.loads(str(schedules["cases"]))):
        config = configs[name]
        if config.get("shift_terminal") and steps == 1:
            assert np.isnan(schedules["sigmas"][i][0])  # diffusers divides by zero there
            with pytest.raises(ValueError, match="shift_terminal"):
                flow.make_schedule(config, steps, seq_len)
            continue
        schedule = flow.make_schedule(config, steps, seq_len)
        assert schedule.sigmas.dtype == schedule.timesteps.dtype == np.float32
        np.testing.assert_array_equal(schedule.sigmas, schedules["sigmas"][i][:steps + 1],
                                      err_msg=f"{name}/{seq_len}/{steps}")
        np.testing.assert_array_equal(schedule.timesteps, schedules["timesteps"][i][:steps],
                                      err_msg=f"{name}/{seq_len}/{steps}")
        assert schedule.mu == pytest.approx(float(schedules["mu"][i]), abs=1e-12)
        assert schedule.sigmas[-1] == 0 and schedule.steps == steps
        compared += 1
    assert compared == 7 * 7 * 5 - 2 * 7


def test_the_dynamic_shift_depends_on_the_image_size(schedules):
    small = flow.make_schedule(tiny_flux.DEV_SCHEDULER, 4, 256)
    large = flow.make_schedule(tiny_flux.DEV_SCHEDULER, 4, 4096)
    assert small.mu == pytest.approx(0.5) and large.mu == pytest.approx(1.15)
    assert np.all(large.sigmas[1:-1] > small.sigmas[1:-1])
    # [schnell]'s static shift of 1 leaves the linspace as it is, whatever the size
    np.testing.assert_array_equal(flow.make_schedule(tiny_flux.SCHNELL_SCHEDULER, 4, 4096).sigmas,
                                  np.array([1, 0.75, 0.5, 0.25, 0], np.float32))


def test_steps_equal_diffusers(schedules):
    """``step`` over a recorded run of ``FlowMatchEulerDiscreteScheduler.step``, in numpy
    and traced by jax, within 1e-5."""
    sigmas, velocities, samples = schedules["step:sigmas"], schedules["step:velocities"], schedules["step:samples"]
    numpy_sample, traced_sample = samples[0], jnp.asarray(samples[0])
    traced_step = jax.jit(flow.step)
    for i in range(len(velocities)):
        numpy_sample = flow.step(numpy_sample, velocities[i], sigmas[i], sigmas[i + 1])
        traced_sample = traced_step(traced_sample, velocities[i], sigmas[i], sigmas[i + 1])
        np.testing.assert_allclose(numpy_sample, samples[i + 1], rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(traced_sample), samples[i + 1], rtol=0, atol=1e-5)
    assert numpy_sample.dtype == np.float32


def test_flux_checkpoints_configs_are_honoured():
    for config in (tiny_flux.SCHNELL_SCHEDULER, tiny_flux.DEV_SCHEDULER, tiny_flux.scheduler_config("tiny-flux")):
        with_metadata = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.30.0.dev0",
                         "a_key_of_another_class": 3, **config}
        assert flow.unsupported(with_metadata) == []
    assert flow.resolved_config({})["shift"] == 1.0 and not flow.resolved_config({})["use_dynamic_shifting"]


@pytest.mark.parametrize("key,value", [
    ("invert_sigmas", True), ("use_karras_sigmas", True), ("use_exponential_sigmas", True),
    ("use_beta_sigmas", True), ("stochastic_sampling", True), ("time_shift_type", "cubic"),
    ("shift_terminal", 1.0), ("shift", 0), ("num_train_timesteps", 0), ("base_shift", None),
    ("max_shift", "high"), ("use_dynamic_shifting", "yes"), ("use_flow_sigmas", True),
    ("_class_name", "EulerDiscreteScheduler"), ("max_image_seq_len", 256),
])
def test_unsupported_refuses_each_key_by_name(key, value):
    config = {**tiny_flux.DEV_SCHEDULER, key: value}
    assert (key, value) in flow.unsupported(config)
    with pytest.raises(ValueError, match=key):
        flow.make_schedule(config, 4, 256)


def test_make_schedule_refuses_a_step_count_below_one():
    with pytest.raises(ValueError, match="steps"):
        flow.make_schedule(tiny_flux.SCHNELL_SCHEDULER, 0, 256)


def test_calculate_shift_interpolates_between_the_two_lengths():
    assert flow.calculate_shift(256) == pytest.approx(0.5)
    assert flow.calculate_shift(4096) == pytest.approx(1.15)
    assert flow.calculate_shift(2176) == pytest.approx(0.825)
    assert flow.calculate_shift(100, 100, 200, 1.0, 2.0) == pytest.approx(1.0)
