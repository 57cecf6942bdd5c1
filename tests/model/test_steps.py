"""Our sampler schedules and steps (pipeline/model/sampling/schedules.py, stepping.py) against diffusers'
PyTorch schedulers.

The fixtures under tests/fixtures/schedulers/ were written once by
tests/fixtures/make_scheduler_fixtures.sh with torch and diffusers 0.39; these tests need
neither. For every fixture case the schedule's timesteps must match exactly (fractional
ones within two float32 ulps), and the sigmas, the scaled inputs and every step's
output within 1e-5 (see ``tolerance`` for the few cases whose magnitudes float32 cannot
resolve to 1e-5), running our own chain from the same initial latents, model outputs
and injected noise. Then pure tests of the schedules and of ``unsupported``.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.model.sampling import multistep, schedules, stepping
from tests.conftest import TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "schedulers")
FILES = ("ddim", "pndm", "euler", "dpmpp", "euler_a", "lcm")
ATOL = 1e-5


def _load(name):
    with np.load(os.path.join(FIXTURES, f"{name}.npz")) as data:
        return {key: data[key] for key in data.files}


INPUTS = _load("inputs")
CASES = {name: _load(name) for name in FILES}


def _case(file, name):
    """One case's fields, its per-step arrays cut out of the file's concatenations."""
    data = CASES[file]
    index = list(data["name"]).index(name)
    lengths = data["lengths"]
    start, n = int(lengths[:index].sum()), int(lengths[index])
    case = dict(name=name, sampler=str(data["sampler"][index]), steps=int(data["steps"][index]),
                config=json.loads(str(data["config"][index])), init_noise_sigma=data["init_noise_sigma"][index],
                timesteps=data["timesteps"][start:start + n], outputs=data["outputs"][start:start + n],
                model_outputs=data["model_outputs"][start:start + n],
                noise_draws=data["noise_draws"][start:start + n])
    if "sigmas" in data:
        case["sigmas"] = data["sigmas"][start + index:start + index + n + 1]
        case["scaled_inputs"] = data["scaled_inputs"][start:start + n]
    return case


ALL_CASES = [(file, str(name)) for file in FILES for name in CASES[file]["name"]]


def _run(schedule, model_outputs, noise, latents):
    """Our chain, as a sampler runs it: (scaled inputs, outputs) of every network call."""
    sample = jnp.asarray(latents) * schedule.init_noise_sigma
    state = stepping.start(schedule, sample)
    scaled, outputs = [], []
    for i in range(schedule.num_steps):
        scaled.append(np.asarray(stepping.scale_input(schedule, i, sample)))
        sample, state = stepping.advance(schedule, i, jnp.asarray(model_outputs[i]), sample,
                                         jnp.asarray(noise[i]) if schedule.stochastic else None, state)
        outputs.append(np.asarray(sample))
    return np.stack(scaled), np.stack(outputs)


def test_fixtures_are_diffusers_039_and_cover_every_sampler_spacing_and_prediction():
    meta = json.loads(str(INPUTS["meta"]))
    assert meta["diffusers"].startswith("0.39.")
    assert "torch" in meta
    covered = {(case["sampler"], case["config"].get("timestep_spacing"), case["config"]["prediction_type"],
                case["steps"]) for case in (_case(*key) for key in ALL_CASES)}
    for sampler in ("ddim", "euler", "euler_a"):
        for spacing in schedules.SPACINGS:
            for prediction in ("epsilon", "v_prediction"):
                for n in (1, 2, 4, 7):
                    assert (sampler, spacing, prediction, n) in covered
    assert {(s, p, n) for s, _, p, n in covered if s == "lcm"} >= {
        ("lcm", p, n) for p in ("epsilon", "v_prediction") for n in (1, 2, 4, 7)}
    for sampler in ("pndm", "dpmpp"):  # the multistep samplers, on every spacing and prediction
        assert {(s, sp, p, n) for s, sp, p, n in covered if s == sampler} >= {
            (sampler, sp, p, n) for sp in schedules.SPACINGS for p in ("epsilon", "v_prediction") for n in (1, 2, 4, 7)}
    prk = [case for case in (_case(*key) for key in ALL_CASES) if case["config"].get("skip_prk_steps") is False]
    assert prk and all(len(case["timesteps"]) == case["steps"] + 9 for case in prk)  # PNDM's Runge-Kutta calls


def tolerance(case, schedule) -> float:
    """1e-5, widened only where float32 itself cannot resolve 1e-5.

    Bit equality is out of reach: torch's CPU sqrt is not correctly rounded (about one
    result in six is one ulp off), and XLA's is. 1e-5 is about 2.5 float32 ulps of 32,
    so up to magnitude 32 the bound is 1e-5 absolute: every case on Stable Diffusion's
    schedule. Beyond that it grows in proportion to the largest magnitude the chain
    reaches (the Euler samplers start at sigma_max * z: 14.6 * z for Stable Diffusion,
    4096 * z with zero terminal SNR), or to the factor by which an epsilon (x0)
    prediction amplifies rounding, 1/sqrt(alpha_bar) (1/sqrt(1 - alpha_bar)): 14.6 at
    t = 999 for Stable Diffusion, 156 for linear betas, some 10^4 for squaredcos_cap_v2.
    """
    reach = max(np.abs(INPUTS["bank_latents"]).max() * float(case["init_noise_sigma"]), np.abs(case["outputs"]).max())
    gain = 1.0
    alpha = np.asarray(schedule.alpha_t, np.float64)
    if schedule.sampler in ("ddim", "lcm") and schedule.prediction_type == "epsilon":
        gain = float((1 / np.sqrt(alpha)).max())
    elif schedule.sampler in ("ddim", "lcm") and schedule.prediction_type == "sample":
        gain = float((1 / np.sqrt(1 - alpha)).max())
    elif schedule.sampler == "dpmpp" and schedule.prediction_type == "epsilon":  # x0 = (x - sigma eps) / alpha
        gain = float((1 / schedule.plan[:, multistep.DPMPP_COLUMNS.index("alpha_s")]).max())
    return ATOL * max(1.0, reach / 32, gain / 32)


def _timesteps_match(ours, theirs):
    """Exactly; fractional ones (from Karras or exponential sigmas, or continuous
    timesteps: derived from torch's float32 sqrt and log) within two float32 ulps."""
    ours = np.asarray(ours, np.float64)
    if np.array_equal(theirs, np.round(theirs)):
        np.testing.assert_array_equal(ours, theirs)
    else:
        np.testing.assert_allclose(ours, theirs, rtol=2.5e-7, atol=1e-7)


@pytest.mark.parametrize("file,name", ALL_CASES, ids=[f"{f}:{n}" for f, n in ALL_CASES])
def test_matches_diffusers_pytorch(file, name):
    case = _case(file, name)
    schedule = schedules.make_schedule(case["config"], case["sampler"], case["steps"])
    _timesteps_match(schedule.timesteps, case["timesteps"])
    np.testing.assert_allclose(schedule.init_noise_sigma, case["init_noise_sigma"], rtol=1e-6)
    if "sigmas" in case:
        np.testing.assert_allclose(schedule.sigmas, case["sigmas"], rtol=1e-6, atol=0)
    # diffusers drew noise exactly where our step takes it: every stochastic step but LCM's last
    expected_draws = np.zeros(schedule.num_steps, np.int8)
    if schedule.sampler == "euler_a":
        expected_draws[:] = 1
    elif schedule.sampler == "lcm":
        expected_draws[:-1] = 1
    np.testing.assert_array_equal(case["noise_draws"], expected_draws)
    scaled, outputs = _run(schedule, case["model_outputs"], INPUTS["bank_noise"], INPUTS["bank_latents"])
    atol = tolerance(case, schedule)
    if "scaled_inputs" in case:
        np.testing.assert_allclose(scaled, case["scaled_inputs"], rtol=0, atol=atol)
    np.testing.assert_allclose(outputs, case["outputs"], rtol=0, atol=atol)


@pytest.mark.parametrize("name,overrides", [
    ("scaled_linear", {}),
    ("linear", dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02)),
    ("squaredcos", dict(beta_schedule="squaredcos_cap_v2")),
    ("zero_snr", dict(rescale_betas_zero_snr=True)),
])
def test_training_schedule_matches_diffusers(name, overrides):
    config = json.loads(str(INPUTS[f"alphas_config_{name}"]))
    assert all(config[key] == value for key, value in overrides.items())
    ours = schedules.alphas_cumprod(schedules.resolved_config(config, "ddim"))
    np.testing.assert_allclose(ours, INPUTS[f"alphas_cumprod_{name}"], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("sampler", schedules.SAMPLERS)
def test_a_whole_chain_runs_in_one_jitted_fori_loop(sampler):
    """The steps trace: the counter of a lax.fori_loop indexes the schedule, and the
    per-step noise comes from fold_in(key, i), as a sampler would draw it."""
    config = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  timestep_spacing="trailing", clip_sample=False)
    schedule = schedules.make_schedule(config, sampler, 4)
    key = jax.random.PRNGKey(3)
    shape = (1, 4, 4, 4)
    model_outputs = jax.random.normal(jax.random.PRNGKey(1), (4,) + shape)
    latents = jax.random.normal(key, shape)

    def noise(i):
        return jax.random.normal(jax.random.fold_in(key, i), shape) if schedule.stochastic else None

    def model(i, sample):  # a stand-in network that reads its scaled input
        return model_outputs[i % 4] + 0.01 * stepping.scale_input(schedule, i, sample)

    @jax.jit
    def loop(schedule, latents):
        def body(i, carry):
            return stepping.advance(schedule, i, model(i, carry[0]), carry[0], noise(i), carry[1])
        start = latents * schedule.init_noise_sigma
        return jax.lax.fori_loop(0, schedule.num_steps, body, (start, stepping.start(schedule, start)))[0]

    looped = loop(schedule, latents)
    sample = latents * schedule.init_noise_sigma
    state = stepping.start(schedule, sample)
    for i in range(schedule.num_steps):
        sample, state = stepping.advance(schedule, i, model(i, sample), sample, noise(i), state)
    # compiled as one program, XLA may round differently from op-by-op (x / sqrt(a) can
    # become x * rsqrt(a)), and random model outputs reach magnitudes near 50 here
    np.testing.assert_allclose(np.asarray(looped), np.asarray(sample), rtol=1e-6, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(looped)))


# -- schedules --------------------------------------------------------------------------

SD = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
          steps_offset=1, clip_sample=False, set_alpha_to_one=False)


@pytest.mark.parametrize("sampler", ("ddim", "euler", "euler_a"))
@pytest.mark.parametrize("spacing", schedules.SPACINGS)
def test_timesteps_descend_and_count_the_steps(sampler, spacing):
    for n in list(range(1, 60)) + [100, 250, 500, 1000]:
        config = dict(SD, timestep_spacing=spacing, steps_offset=0 if n == 1000 else 1)
        schedule = schedules.make_schedule(config, sampler, n)
        t = np.asarray(schedule.timesteps, np.float64)
        assert np.all(np.diff(t) < 0), (n, t)
        assert 0 <= t.min() and t.max() <= 999
        assert schedule.num_steps == n
        if sampler != "ddim":
            sigmas = np.asarray(schedule.sigmas)
            assert sigmas.shape == (n + 1,) and sigmas[-1] == 0 and np.all(np.diff(sigmas) < 0)


@pytest.mark.parametrize("sampler", ("ddim", "euler", "euler_a"))
def test_trailing_starts_at_the_last_training_timestep(sampler):
    for n in (1, 2, 3, 4, 7, 8, 25, 50):
        schedule = schedules.make_schedule(dict(SD, timestep_spacing="trailing"), sampler, n)
        assert schedule.timesteps[0] == 999
        assert schedules.make_schedule(dict(SD, timestep_spacing="trailing", num_train_timesteps=500), sampler,
                                   n).timesteps[0] == 499


@pytest.mark.parametrize("sampler", ("ddim", "euler", "euler_a"))
def test_trailing_step_counts_that_would_reach_timestep_minus_one_are_refused(sampler):
    # np.arange(1000, 0, -1000 / 61) has 62 entries, the last rounding to timestep -1
    for n in (61, 103, 121):
        with pytest.raises(ValueError, match=f"trailing spacing with {n} steps"):
            schedules.make_schedule(dict(SD, timestep_spacing="trailing"), sampler, n)
    assert schedules.make_schedule(dict(SD, timestep_spacing="leading"), sampler, 61).num_steps == 61


@pytest.mark.parametrize("sampler", ("ddim", "euler", "euler_a"))
def test_leading_spacing_past_the_last_timestep_is_refused(sampler):
    with pytest.raises(ValueError, match="reaches timestep 1000"):
        schedules.make_schedule(dict(SD, timestep_spacing="leading", steps_offset=1), sampler, 1000)


def test_leading_adds_the_offset_and_linspace_spans_the_range():
    def ddim(**config):
        return list(schedules.make_schedule(dict(SD, **config), "ddim", 4).timesteps)

    assert ddim(timestep_spacing="leading") == [751, 501, 251, 1]
    assert ddim(timestep_spacing="leading", steps_offset=0) == [750, 500, 250, 0]
    assert ddim(timestep_spacing="linspace") == [999, 666, 333, 0]
    assert ddim(timestep_spacing="trailing") == [999, 749, 499, 249]
    euler = schedules.make_schedule(dict(SD, timestep_spacing="linspace"), "euler", 4)
    np.testing.assert_array_equal(euler.timesteps, np.array([999, 666, 333, 0], np.float32))


def test_initial_noise_sigma_follows_the_spacing():
    for spacing in ("linspace", "trailing"):
        schedule = schedules.make_schedule(dict(SD, timestep_spacing=spacing), "euler", 4)
        assert schedule.init_noise_sigma == schedule.sigmas.max()
    leading = schedules.make_schedule(dict(SD, timestep_spacing="leading"), "euler_a", 4)
    assert leading.init_noise_sigma == pytest.approx(float(np.sqrt(leading.sigmas.max() ** 2 + 1)), rel=1e-6)
    assert schedules.make_schedule(SD, "ddim", 4).init_noise_sigma == 1.0
    assert schedules.make_schedule(SD, "lcm", 4).init_noise_sigma == 1.0


def test_karras_sigmas_descend_between_the_bounds():
    schedule = schedules.make_schedule(dict(SD, use_karras_sigmas=True, sigma_min=0.1, sigma_max=10.0), "euler", 6)
    sigmas = np.asarray(schedule.sigmas)
    assert sigmas[0] == pytest.approx(10.0, rel=1e-6) and sigmas[-2] == pytest.approx(0.1, rel=1e-6)
    assert np.all(np.diff(sigmas) < 0) and np.all(np.diff(np.asarray(schedule.timesteps)) < 0)


def test_lcm_picks_from_the_distillation_schedule():
    schedule = schedules.make_schedule(SD, "lcm", 4)
    assert list(schedule.timesteps) == [999, 759, 499, 259]
    assert list(schedule.inject) == [1, 1, 1, 0]
    # a consistency model's boundary condition: c_skip -> 1 and c_out -> 0 as t -> 0
    tiny = schedules.make_schedule(dict(SD, original_inference_steps=1000, num_train_timesteps=1000), "lcm", 1000)
    assert tiny.c_skip[-1] == pytest.approx(0.25 / (0.0 + 0.25)) and tiny.c_out[-1] == 0.0
    with pytest.raises(ValueError, match="original_inference_steps"):
        schedules.make_schedule(SD, "lcm", 51)


def test_trained_betas_replace_the_beta_schedule():
    scaled = (np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2).tolist()
    given = schedules.make_schedule(dict(SD, beta_schedule="linear", trained_betas=scaled), "euler", 4)
    np.testing.assert_allclose(given.sigmas, schedules.make_schedule(SD, "euler", 4).sigmas, rtol=1e-6)
    with pytest.raises(ValueError, match="trained_betas has 3 values"):
        schedules.make_schedule(dict(SD, trained_betas=[0.1, 0.2, 0.3]), "ddim", 2)


@pytest.mark.parametrize("steps_value", [0, -1, 1001, 2.0, True])
def test_bad_step_counts_are_refused(steps_value):
    with pytest.raises(ValueError, match="steps"):
        schedules.make_schedule(SD, "ddim", steps_value)


# -- unsupported ------------------------------------------------------------------------

@pytest.mark.parametrize("sampler,key,value", [
    ("ddim", "thresholding", True),
    ("ddim", "timestep_spacing", "uniform"),
    ("ddim", "beta_schedule", "sigmoid"),
    ("ddim", "prediction_type", "flow"),
    ("lcm", "thresholding", True),
    ("euler", "interpolation_type", "log_linear"),
    ("euler", "use_beta_sigmas", True),
    ("euler", "final_sigmas_type", "max"),
    ("euler", "timestep_type", "other"),
    ("euler_a", "prediction_type", "sample"),
    ("euler_a", "timestep_spacing", "karras"),
    ("lcm", "original_inference_steps", 0),
])
def test_unsupported_names_the_key_and_its_value(sampler, key, value):
    config = dict(SD, **{key: value})
    assert schedules.unsupported(config, sampler) == [(key, value)]
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        schedules.make_schedule(config, sampler, 4)


def test_unsupported_lists_every_offending_key():
    config = dict(SD, thresholding=True, timestep_spacing="uniform", prediction_type="flow")
    assert sorted(schedules.unsupported(config, "ddim")) == [
        ("prediction_type", "flow"), ("thresholding", True), ("timestep_spacing", "uniform")]
    both = dict(SD, use_karras_sigmas=True, use_exponential_sigmas=True)
    assert schedules.unsupported(both, "euler") == [("use_exponential_sigmas", True)]


@pytest.mark.parametrize("sampler", schedules.SAMPLERS)
def test_keys_the_scheduler_class_lacks_and_metadata_are_not_refused(sampler):
    # a Stable Diffusion 1.5 scheduler_config.json, written for PNDM
    config = dict(SD, _class_name="PNDMScheduler", _diffusers_version="0.6.0", skip_prk_steps=True,
                  trained_betas=None)
    assert schedules.unsupported(config, sampler) == []
    assert schedules.unsupported({**config, "thresholding": True}, "euler") == []  # Euler has no thresholding


def test_lcm_ignores_spacing_as_diffusers_does():
    a = schedules.make_schedule(dict(SD, timestep_spacing="trailing"), "lcm", 4)
    b = schedules.make_schedule(dict(SD, timestep_spacing="leading", steps_offset=0), "lcm", 4)
    np.testing.assert_array_equal(a.timesteps, b.timesteps)


def test_unknown_sampler_is_refused():
    with pytest.raises(ValueError, match="heun"):
        schedules.unsupported(SD, "heun")


def test_step_takes_noise_exactly_when_the_sampler_is_stochastic():
    sample = jnp.ones((1, 4, 2, 2))
    for sampler in schedules.SAMPLERS:
        schedule = schedules.make_schedule(dict(SD, skip_prk_steps=True), sampler, 2)
        state = stepping.start(schedule, sample)
        if schedule.stochastic:
            with pytest.raises(ValueError, match="noise"):
                stepping.advance(schedule, 0, sample, sample, None, state)
        else:
            with pytest.raises(ValueError, match="no noise"):
                stepping.advance(schedule, 0, sample, sample, sample, state)
        if sampler in ("pndm", "dpmpp"):  # a state to keep: not a plain step
            with pytest.raises(ValueError, match="advance"):
                stepping.step(schedule, 0, sample, sample)
    assert schedules.STOCHASTIC == {"euler_a", "lcm"}


def test_stochastic_steps_use_their_noise():
    sample = jnp.ones((1, 4, 2, 2))
    for sampler in ("euler_a", "lcm"):
        schedule = schedules.make_schedule(SD, sampler, 4)
        a = stepping.step(schedule, 0, sample, sample, jnp.zeros_like(sample))
        b = stepping.step(schedule, 0, sample, sample, jnp.ones_like(sample))
        assert not np.allclose(a, b)
    # LCM's last step returns the denoised sample, whatever the noise
    lcm = schedules.make_schedule(SD, "lcm", 4)
    np.testing.assert_array_equal(stepping.step(lcm, 3, sample, sample, jnp.zeros_like(sample)),
                                  stepping.step(lcm, 3, sample, sample, jnp.ones_like(sample)))
