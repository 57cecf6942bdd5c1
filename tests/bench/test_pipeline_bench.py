import os

import numpy as np
import pytest
from PIL import Image

from pipeline.bench import host_overhead as pipeline_bench
from pipeline.core import naming
from pipeline.io import runs, storage
from pipeline.output import writer


def test_synthetic_generator_is_asynchronous_and_fixed():
    generator = pipeline_bench.SyntheticGenerator(2, 16, 8, 0.2)
    try:
        start = pipeline_bench.time.perf_counter()
        handle = generator.dispatch(generator.batch_of([("a", "", 7.5, 0, 0), ("b", "", 7.5, 1, 0)]))
        assert pipeline_bench.time.perf_counter() - start < 0.1  # dispatch does not wait for the step
        images, latents = generator.fetch(handle)
        assert pipeline_bench.time.perf_counter() - start >= 0.2
        assert images.shape == (2, 8, 16, 3) and images.dtype == np.uint8 and latents is None
        again, _ = generator.generate(("c", "d"))
        np.testing.assert_array_equal(images, again)
        assert images is not again and images[0].std() > 50  # noise, a fresh copy per step
        assert generator.truncated(["a", "b"]) == [False, False]
        with pytest.raises(ValueError):
            generator.dispatch(("only one",))
    finally:
        generator.close()


def test_plan_is_readable_by_the_host(tmp_path):
    out = str(tmp_path)
    run = pipeline_bench.bench_run(16, 8, 0, 4)
    plan = pipeline_bench.write_plan(out, run, 2, 8)
    assert [len(items) for items in plan] == [8, 8]
    assert writer.read_slice_items(out, 1) == plan[1]
    assert [item.slice for item in plan[1]] == [1] * 8 and plan[1][0].position == 8
    assert runs.read(out) == run


def test_smoke_synthetic_every_mode(tmp_path):
    workdir = str(tmp_path / "work")
    config = pipeline_bench.PipelineBenchConfig(generator="synthetic", width=64, height=64, batch=4,
                                                seconds_per_batch=0.05, slices=2, batches_per_slice=2,
                                                workdir=workdir, report=str(tmp_path / "report.json"))
    report = pipeline_bench.run(config)
    assert storage.read_json(config.report) == report
    assert report["config"]["images_per_mode"] == 16
    modes = report["modes"]
    assert set(modes) == {"generator", "pipeline_local", "beam_local", "sequential"}
    for mode in modes.values():
        assert mode["images"] == 16 and mode["seconds"] > 0 and mode["images_per_s"] > 0
        assert mode["peak_rss_mib"] > 0
    # a device step takes 0.05 s, and every mode waits for all 4 of them (2 slices x 2 batches)
    assert min(m["seconds"] for m in modes.values()) >= 4 * 0.05
    local = modes["pipeline_local"]
    assert local["files"] == 16 and modes["sequential"]["files"] == 16
    pngs = sorted(p for p in storage.glob(naming.join(workdir, "local", "images", "*", "*.png")))
    assert len(pngs) == 16
    for path in pngs:
        with Image.open(path) as image:
            assert image.size == (64, 64) and image.mode == "RGB"
    for index in range(2):
        assert writer.is_committed(os.path.join(workdir, "local"), index)
    assert min(local["input_s"], local["device_wait_s"], local["output_s"]) >= 0
    assert local["bottleneck"] in ("input", "device", "output")
    # the stand-in device was busy 0.05 s for each of its 4 steps, and not longer than the run
    assert 4 * 0.05 * 0.95 <= local["device_busy_s"] <= local["seconds"]
    assert local["device_busy_fraction"] == pytest.approx(local["device_busy_s"] / local["seconds"], abs=1e-3)
    assert len(local["slice_seconds"]) == 2 and len(local["rss_after_commit_mib"]) == 2
    assert all(0 < rss <= local["peak_rss_mib"] + 1 for rss in local["rss_after_commit_mib"])
    ratios = report["ratios"]
    assert ratios["pipeline_local_over_generator"] == pytest.approx(
        local["images_per_s"] / modes["generator"]["images_per_s"], rel=1e-3)
    assert ratios["pipeline_local_over_sequential"] == pytest.approx(
        local["images_per_s"] / modes["sequential"]["images_per_s"], rel=1e-3)
    assert ratios["pipeline_gcs_over_generator"] is None
    assert "pipeline_local" in pipeline_bench.table(report)
    # the beam engine's DoFn ran the same slices on the DirectRunner, committed, on the same device
    beam = modes["beam_local"]
    assert beam["files"] == 16 and beam["runner_wall_s"] >= beam["seconds"]
    assert all(writer.is_committed(os.path.join(workdir, "beam"), index) for index in range(2))
    assert 4 * 0.05 * 0.95 <= beam["device_busy_s"] <= beam["seconds"]
    assert ratios["beam_local_over_generator"] == pytest.approx(
        beam["images_per_s"] / modes["generator"]["images_per_s"], rel=1e-3)
    assert "(b') beam local_over_generator" in pipeline_bench.table(report)


def test_bad_config_is_refused():
    with pytest.raises(ValueError):
        pipeline_bench.PipelineBenchConfig(generator="real").validate()
    with pytest.raises(ValueError):
        pipeline_bench.PipelineBenchConfig(width=60).validate()
    with pytest.raises(ValueError, match="--modes"):
        pipeline_bench.PipelineBenchConfig(modes=("pipeline", "seed")).validate()
