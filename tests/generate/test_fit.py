"""``--per-device-batch auto``: the largest per-device batch whose compiled sampler fits a device.

The search (``largest_batch``) and the capacity are pure and tested with made-up
figures; the tiny model then shows the whole path: the sampler compiled from shapes has
the memory of the program a host compiles, the choice is the largest that fits, the
plan slices with it, and a resumed run keeps it without compiling again.
"""
import json
import types

import pytest

from jobs import cli, flags
from pipeline.core.settings import AUTO, Settings
from pipeline.generate import fit
from pipeline.generate.spec import ProgramSpec

GIB = fit.GIB


def linear(base: int, per_image: int, calls: list):
    def needs(b):
        calls.append(b)
        return base + per_image * b
    return needs


@pytest.mark.parametrize("base, per_image, capacity, expected", [
    (100, 10, 1000, 90),  # 100 + 10 b <= 1000
    (100, 10, 109, None),  # even b = 1 needs 110
    (100, 10, 110, 1),
    (100, 10, 125, 2),
    (0, 1, 10 ** 9, fit.MOST_PER_DEVICE),  # capped
    (500, 0, 1000, fit.MOST_PER_DEVICE),  # memory that does not grow with b
])
def test_largest_batch_on_a_line(base, per_image, capacity, expected):
    calls = []
    if expected is None:
        with pytest.raises(fit.FitError, match="one image per device needs"):
            fit.largest_batch(linear(base, per_image, calls), capacity)
        return
    chosen, tried = fit.largest_batch(linear(base, per_image, calls), capacity)
    assert chosen == expected
    assert len(calls) == len(set(calls)) <= 4  # each b compiled once, the line guessed right
    assert tried[chosen] <= capacity
    assert chosen == fit.MOST_PER_DEVICE or tried[chosen + 1] > capacity  # the next one was shown not to fit


def test_largest_batch_when_the_line_guesses_wrong():
    # memory that jumps above b = 40 (XLA changed its plan): the guess (90) does not fit,
    # and bisection finds the true edge
    def needs(b):
        return 100 + 10 * b + (10 ** 6 if b > 40 else 0)

    chosen, tried = fit.largest_batch(needs, 1000)
    assert chosen == 40 and tried[41] > 1000 and len(tried) <= 12
    # and one that grows faster than the line: the guess does not fit either
    chosen, _ = fit.largest_batch(lambda b: 100 * b * b, 10_000)
    assert chosen == 10


@pytest.mark.parametrize("capacity, expected", [(1000, 46), (1600, 86), (700, 26)])
def test_largest_batch_when_the_first_image_costs_more_than_the_next(capacity, expected):
    # 100 MiB-like units: the second image adds 110, every one after it 15 (as SD 1.5's
    # decode on a TPU chip does); the line through 1 and 2 guesses far too few, the line
    # through 2 and that guess finds the edge, with no bisection up to the cap
    calls = []

    def needs(b):
        calls.append(b)
        return 230 + 110 * min(b - 1, 1) + 15 * max(b - 2, 0)

    chosen, tried = fit.largest_batch(needs, capacity)
    assert chosen == expected and tried[expected] <= capacity < tried[expected + 1]
    assert len(calls) == len(set(calls)) <= 6


def test_device_capacity_sources():
    cpu = types.SimpleNamespace(memory_stats=lambda: None, device_kind="cpu")
    tpu = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": 16 * GIB}, device_kind="TPU v5 lite")
    assert fit.device_capacity([tpu], 8.0) == (int(8 * GIB * fit.HEADROOM), "--device-memory")
    assert fit.device_capacity([tpu]) == (int(16 * GIB * fit.HEADROOM), "TPU v5 lite bytes_limit")
    one, source = fit.device_capacity([cpu])
    four, _ = fit.device_capacity([cpu], devices_on_machine=4)
    assert one > 0 and "machine memory" in source and four == pytest.approx(one / 4, abs=1)


def test_flags_take_auto_and_refuse_what_auto_would_ignore():
    parser = cli.build_parser()
    args = parser.parse_args(["run", "--per-device-batch", "auto", "--device-memory", "16"])
    settings = flags.settings_from_args(args, 1)
    assert settings.per_device_batch == AUTO and settings.device_memory == 16.0
    assert settings.validate() is settings
    with pytest.raises(ValueError, match="resolved to a number before planning"):
        settings.slice_size
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--per-device-batch", "most"])
    args = parser.parse_args(["run", "--per-device-batch", "4", "--device-memory", "16"])
    with pytest.raises(ValueError, match="--device-memory is read only by --per-device-batch auto"):
        flags.settings_from_args(args, 1)
    with pytest.raises(ValueError, match="--device-memory must be a number of GiB in"):
        Settings(per_device_batch=AUTO, device_memory=0).validate()
    # device_memory only chose the batch: it is not part of the run's fingerprint
    from pipeline.core.settings import fingerprint
    assert fingerprint(Settings(per_device_batch=2, device_memory=3.0), "m") == fingerprint(
        Settings(per_device_batch=2), "m")


def test_auto_picks_the_largest_batch_that_fits_and_a_resumed_run_keeps_it(tmp_path, model_cache, monkeypatch):
    import jax

    from pipeline.generate.generator import Generator
    from pipeline.model import load
    from pipeline.plan import transforms as plan

    # each batch's program is compiled once in this test (they take seconds each)
    compiled, original = {}, fit.sampler_memory

    def sampler_memory(model, spec, *args, **kwargs):
        b = spec.per_device_batch
        if b not in compiled:
            compiled[b] = original(model, spec, *args, **kwargs)
        return compiled[b]

    monkeypatch.setattr(fit, "sampler_memory", sampler_memory)
    # the program compiled from shapes is the one a host compiles from real weights
    abstract = load.load("tiny", abstract=True)
    host = Generator(load.load("tiny"), ProgramSpec(32, 32, 1, 2), devices=jax.local_devices()[:1])
    assert fit.sampler_memory(abstract, ProgramSpec(32, 32, 1, 2)) == fit.program_memory(host.compiled)

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"p {i}"}) + "\n" for i in range(5)))
    out = str(tmp_path / "out")
    # room for 2 images' programs and not 3
    two, three = (fit.sampler_memory(abstract, ProgramSpec(32, 32, 1, b))["total"] for b in (2, 3))
    device_memory = (two + three) / 2 / fit.HEADROOM / GIB
    asked = Settings(prompts=str(prompts), out=out, width=32, height=32, steps=1, per_device_batch=AUTO,
                     device_memory=device_memory, batches_per_slice=1)
    settings = fit.resolve_per_device_batch(asked)
    assert settings.per_device_batch == 2 and sorted(compiled) == [1, 2, 3]
    manifest = plan.run_plan(settings)
    assert manifest["slice_size"] == 2 and manifest["slices"] == 3

    def must_not_compile(*args, **kwargs):
        raise AssertionError("a resumed run chose again")

    monkeypatch.setattr(fit, "choose_per_device_batch", must_not_compile)
    assert fit.resolve_per_device_batch(asked.replace(device_memory=1.0)).per_device_batch == 2


def test_auto_refuses_a_size_the_models_family_does_not_make_before_compiling_at_it(model_cache, monkeypatch):
    monkeypatch.setattr(fit, "choose_per_device_batch", lambda *a, **k: pytest.fail("compiled at a refused size"))
    with pytest.raises(ValueError, match=r"--width 20: tiny's images are multiples of 8 pixels each way"):
        fit.resolve_per_device_batch(Settings(model="tiny", width=20, per_device_batch=AUTO))
