"""``promptmill bench generator`` on the tiny model: every field of the report is there and sane.

Timings are only checked for being positive: wall clock is no test on a shared machine.
"""
import json

import pytest

from jobs import cli
from pipeline.bench import scoring_overhead, startup, throughput, throughput_config, throughput_table
from pipeline.bench.throughput_config import BenchConfig


def test_batch_sizes_flag_and_bad_configs():
    args = cli.build_parser().parse_args(["bench", "generator", "--per-device-batch", "1,2,4"])
    assert args.per_device_batch == (1, 2, 4) and args.target == "generator"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "generator", "--per-device-batch", "1,x"])
    with pytest.raises(ValueError):
        BenchConfig(per_device_batches=(0,)).validate()
    with pytest.raises(ValueError):
        BenchConfig(width=30).validate()
    with pytest.raises(ValueError, match="--parts"):
        BenchConfig(parts=("sweep", "speed")).validate()
    with pytest.raises(ValueError, match="--compare-models"):
        BenchConfig(parts=("models",)).validate()
    args = cli.build_parser().parse_args(["bench", "generator", "--parts", "recipes"])
    assert args.parts == "recipes"


def test_the_seed_notebook_sweep_without_its_extra_is_a_clear_error_before_any_work(monkeypatch, model_cache):
    """diffusers (the seed notebook's FlaxStableDiffusionPipeline) is no dependency of
    promptmill: the sweep asks for the notebook extra by name; the default parts need none."""
    import sys

    monkeypatch.setitem(sys.modules, "diffusers", None)  # as where it is not installed
    with pytest.raises(RuntimeError, match=r"pip install 'promptmill\[notebook\]'"):
        throughput.run_bench(BenchConfig(parts=("sweep",)))
    assert "sweep" not in throughput_config.DEFAULT_PARTS


def test_bench_generator_report(tmp_path, model_cache, capsys):
    path = tmp_path / "report.json"
    # at --steps 4 the guidance-free recipe and the few-step one are one program, compiled once
    code = cli.main(["bench", "generator", "--model", "tiny", "--width", "32", "--height", "32", "--steps", "4",
                     "--per-device-batch", "1", "--batches", "1", "--matmul-size", "512", "--report", str(path),
                     "--scheduler", "euler_a", "--timestep-spacing", "trailing",
                     "--parts", "recipes,attention,memory,startup,models", "--attentions", "xla,auto",
                     "--memory-sizes", "32,64", "--compare-models", "tiny-flux"])
    assert code == 0
    table = capsys.readouterr().out
    assert "cold/warm" in table and "guidance-free / CFG at 4 steps" in table
    assert "models side by side" in table
    report = json.loads(path.read_text())
    assert report["command"].startswith("promptmill bench generator --model tiny")
    assert "--compare-models tiny-flux" in report["command"]
    # the models part: each model at its own default guidance, SD's guided, FLUX.1 [schnell]'s not
    rows = report["models"]["rows"]
    assert list(rows) == ["tiny", "tiny-flux"] and rows["tiny"]["over_first"] == 1
    assert (rows["tiny"]["guided"], rows["tiny-flux"]["guided"]) == (True, False)
    assert all(r["images_per_s"] > 0 and r["flops_per_image"] > 0 for r in rows.values())
    assert report["machine"]["platform"] == "cpu" and report["machine"]["devices"] == 2
    assert report["peak"]["flops_per_s"] > 0

    assert report["sweep"] is None  # the sweep needs the notebook extra: see the test below

    compared = report["recipes"]
    recipes = compared["recipes"]
    assert {name: (r["scheduler"], r["timestep_spacing"], r["steps"], r["guided"]) for name, r in recipes.items()} == {
        "cfg": ("euler_a", "trailing", 4, True), "guidance_free": ("euler_a", "trailing", 4, False),
        "guidance_free_2x": ("euler_a", "trailing", 4, False),
        "few_step": ("euler_a", "trailing", 4, False), "default": ("ddim", "leading", 20, True)}  # tiny's own
    cfg, free = recipes["cfg"]["flops"], recipes["guidance_free"]["flops"]
    # XLA counts the fori_loop's body once: the reason the flops are counted by parts
    # (pipeline/bench/flops.py). If this changes, revisit that module.
    assert cfg["xla_denoiser_calls_counted"] == pytest.approx(1.0, abs=0.05)
    # by parts: the guidance-free program encodes and denoises half the rows, and decodes as many
    assert cfg["denoiser_call"] == pytest.approx(2 * free["denoiser_call"], rel=0.01)
    assert cfg["text_encoder"] == pytest.approx(2 * free["text_encoder"], rel=0.01)
    assert cfg["vae_decode"] == free["vae_decode"]
    assert [recipes[name]["batch_size"] for name in ("cfg", "guidance_free", "guidance_free_2x")] == [2, 2, 4]
    assert compared["flops_default_over_few_step"] > compared["flops_cfg_over_guidance_free"] > 1
    assert all(r["images_per_s"] > 0 for r in recipes.values())
    assert compared["guidance_free_over_cfg"] > 0 and compared["few_step_over_default"] > 0
    assert compared["guidance_free_2x_over_cfg"] > 0
    # at --steps 4 the few-step recipe is the guidance-free program: built and timed once
    assert recipes["few_step"]["same_program_as"] == "guidance_free" and "same_program_as" not in recipes["cfg"]
    assert recipes["few_step"]["images_per_s"] == recipes["guidance_free"]["images_per_s"]

    # attention side by side: speed in turns, each program's memory, the kernels auto chose
    compared = report["attention"]
    assert compared["relative_to"] == "xla" and list(compared["implementations"]) == ["xla", "auto"]
    for name, row in compared["implementations"].items():
        assert row["images_per_s"] > 0 and row["memory"]["temp"] > 0 and row["batch_size"] == 2
    assert compared["implementations"]["xla"]["over_first"] == 1.0
    auto_kernels = compared["implementations"]["auto"]["kernels"]
    assert auto_kernels and set(auto_kernels) <= {"xla", "chunked"}  # on CPU
    assert "attention at 32x32" in table and "temp 64^2 / 32^2 with auto" in table
    # memory from shapes: the whole matrix (xla) grows with the square of the pixels, auto's with the pixels
    memory = report["memory"]
    assert [(row["attention"], row["size"]) for row in memory["rows"]] == [
        ("xla", 32), ("xla", 64), ("auto", 32), ("auto", 64)]
    assert memory["pixel_growth"] == 4.0
    # the bench's own size was measured by the attention part: its programs are not compiled again
    assert [row["measured"] for row in memory["rows"]] == ["attention part", "from shapes"] * 2
    assert [row["memory"] for row in memory["rows"] if row["size"] == 32] == \
        [compared["implementations"][name]["memory"] for name in ("xla", "auto")]
    assert memory["temp_growth"]["auto"] <= 4.5 < memory["temp_growth"]["xla"]

    # the cfg recipe's sampler is xla's and auto's in the attention part (at 32x32 on CPU auto
    # runs xla everywhere: one program) and the models part's: compiled once, built on thrice
    assert report["programs"] == {"compiled": 4, "shared": 3}

    start = report["startup"]
    assert start["cache_entries"] > 0
    assert start["cold"]["build_cache_hits"] == 0 and start["warm"]["build_cache_hits"] >= 1
    assert start["cold"]["total_s"] > 0 and start["warm"]["total_s"] > 0 and start["cold_over_warm"] > 0
    # warm, the sampler is deserialised, not compiled; the time to ready leaves out the first batch
    assert not start["cold"]["sampler_from_cache"] and start["warm"]["sampler_from_cache"]
    assert start["warm"]["sampler_compiles"] == 0 < start["cold"]["sampler_compiles"]
    # warm, it was found through the index: nothing traced
    assert start["cold"]["sampler_lowered"] and not start["warm"]["sampler_lowered"]
    for side in (start["cold"], start["warm"]):
        assert side["program_reused"]  # made on a thread while the weights loaded, and used
        parts = sum(side[f"{part}_s"] for part in ("import", "load", "wait", "transfer"))
        # (each figure is rounded to the millisecond: a sum of two may pass the total by one)
        assert parts <= side["ready_s"] + 0.01
        assert side["ready_s"] + side["first_batch_s"] <= side["in_process_s"] + 0.0015
    assert start["ready_warm_over_cold"] == start["warm"]["ready_s"] / start["cold"]["ready_s"]
    assert "time to ready" in table and "compile or deserialize" in table
    assert "against" not in start


def test_startup_against_times_another_tree_in_turns_and_says_each_over_the_other(monkeypatch):
    """--startup-against DIR: ``startup.cold_and_warm`` is given both roots (this tree first;
    each a fresh process on caches of its own: tests/bench/test_bench.py's run above measures one),
    and the report gives this tree's times over the other's."""
    asked = []

    def fake(model, width, height, steps, batch, dtype, devices, *, roots):
        asked.append(roots)
        return [{"cold": {**figures, "ready_s": ready}, "warm": {**figures, "ready_s": ready / 4},
                 "cache_entries": 3} for ready in (2.0, 4.0)[:len(roots)]]

    figures = {"total_s": 8.0, "sampler_from_cache": False, "cache_hits": 0,
               **{key: 1.0 for _, key in throughput_table.STARTUP_ROWS if key not in ("ready_s", "total_s")}}
    monkeypatch.setattr(startup, "cold_and_warm", fake)
    result = throughput.run_startup(BenchConfig(startup_against="/other/tree"), 32, 32, 1)
    assert asked == [(None, "/other/tree")]
    other = result["against"]
    assert other["root"] == "/other/tree" and other["cold"]["ready_s"] == 4.0
    assert other["over_against"] == {"cold_ready_s": 0.5, "cold_total_s": 1.0, "warm_ready_s": 0.5,
                                     "warm_total_s": 1.0}
    table = throughput_table.format_table({**{k: None for k in ("sweep", "recipes", "attention", "memory", "models", "fsdp",
                                                       "flops")}, "startup": result, "peak": {"flops_per_s": 1e9},
                                "config": {"model": "tiny", "width": 32, "height": 32, "steps": 4, "dtype": "fp32"},
                                "machine": {"devices": 1, "device_kind": "cpu", "platform": "cpu"}})
    assert "side by side with /other/tree (timed in turns)" in table


def test_the_matmul_peak_keeps_no_more_than_two_products_alive(monkeypatch):
    """Timed over enough calls to last ``min_seconds``: on an accelerator that is thousands of
    products, so each must be dropped as the next is queued (kept in a list, an H100's
    80 GB filled before a second had passed)."""
    import weakref

    import jax

    from pipeline.bench import flops

    real_jit, most = jax.jit, []

    def jit(f, **kwargs):  # counts the outputs of each jitted function still alive at each call
        compiled, alive, index = real_jit(f, **kwargs), [], len(most)
        most.append(0)

        def call(x):
            out = compiled(x)
            alive.append(weakref.ref(out))
            most[index] = max(most[index], sum(ref() is not None for ref in alive))
            return out
        return call

    monkeypatch.setattr(jax, "jit", jit)
    result = flops.matmul_peak(jax.devices()[:1], "fp32", 32, min_seconds=0.05)
    assert result["calls"] >= 16 and result["flops_per_s"] > 0
    assert max(most) <= 2  # the product in hand and the one being made


def test_flops_per_image_do_not_depend_on_the_batch(model_cache):
    from pipeline.bench import flops
    from pipeline.model import load

    model = load.load("tiny", abstract=True)  # the parts are lowered from shapes: no weights needed
    one, two = (flops.sampler_flops(model, 32, 32, 2, b)["per_image"] for b in (1, 2))
    assert one > 0 and two == pytest.approx(one, rel=0.01)


def test_sdxl_is_refused_before_any_work(model_cache):
    # the seed recipe is FlaxStableDiffusionPipeline's: there is no SD 1.x baseline for SDXL
    with pytest.raises(ValueError, match="'tiny-sdxl' is not SD 1.x/2.x"):
        throughput.run_bench(BenchConfig(model="tiny-sdxl", width=32, height=32))


def test_the_scoring_part_times_the_generator_with_and_without_scores(model_cache):
    """``--parts scoring``: the same generator with and without the scoring program, in
    turns; the overhead and the FLOPs the scorers add (here with the tiny scorers, the
    real-size ones being the bench's default, one recipe and the reference size's FLOPs
    at 64x64: the suite's time)."""
    from pipeline.model import load as model_lib

    config = BenchConfig(model="tiny", width=32, height=32, steps=1, batches=1, parts=("scoring",),
                               scorers="tiny").validate()
    assert "--scorers tiny" in throughput_config.command_line(config)
    model = model_lib.load("tiny")
    import jax

    report = scoring_overhead.run_scoring(model, config, jax.local_devices(), 32, 32, reference=(64, 2),
                               recipes_run=("one_step",))
    assert report["scorers"]["clip_model"] == "tiny-clip" and report["scorer_flops_per_image"] > 0
    assert list(report["recipes"]) == ["one_step"]
    for name, steps in (("one_step", 1),):
        row = report["recipes"][name]
        assert row["steps"] == steps and row["plain"]["images_per_s"] > 0 and row["scored"]["images_per_s"] > 0
        assert row["overhead"] == 1 - row["scored"]["images_per_s"] / row["plain"]["images_per_s"]
        assert 0 < row["scorer_flops_over_sampler"] < 1
    at_512 = report["flops_at_512"]
    assert at_512["one_step_scorer_over_sampler"] > at_512["cfg_20_steps_scorer_over_sampler"] > 0
    assert "scoring overhead" in throughput_table.format_table({**EMPTY_REPORT, "scoring": report})
    with pytest.raises(ValueError, match="--scorers must be one of random, tiny"):
        BenchConfig(scorers="huge").validate()


EMPTY_REPORT = {"config": {"model": "tiny", "width": 32, "height": 32, "steps": 1, "dtype": "fp32"},
                "machine": {"devices": 2, "device_kind": "cpu", "platform": "cpu"}, "peak": {"flops_per_s": 1.0},
                "sweep": None, "recipes": None, "startup": None}
