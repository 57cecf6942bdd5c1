"""The beam engine (``pipeline.engines.beam``): the whole job as one Beam pipeline.

Real runs: Beam runners in this process (FnApiRunner, BundleBasedDirectRunner), the tiny
model on 2 CPU devices (conftest), and, for comparison, the pod engine through the CLI
(``promptmill run``: plan, one jax.distributed host process with 2 devices, collect).
All in-process beam runs share one compiled generator (one per process, by design), so
only the first one compiles.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from PIL import Image

from pipeline.collect import parts
from pipeline.core import logs, naming
from pipeline.core.settings import Settings
from pipeline.engines import beam as beam_engine, beam_worker
from pipeline.io import runs, storage
from pipeline.model import sharding as model_sharding
from pipeline.output import formats, writer
from pipeline.plan import transforms as plan
from tests.conftest import ROOT

STEPS = 2


def write_prompts(folder) -> str:
    """9 rows: 8 good records (one with 2 images, so 9 images: slices of 4, 4 and 1) and one bad row."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"a {'red' if n % 2 else 'blue'} thing, number {n}", "theme": n % 3} for n in range(8)]
    rows[1].update(id="named", negative_prompt="blurry")
    rows[2]["num_images"] = 2
    rows[3]["seed"] = 2**40 + 7
    rows[5]["guidance_scale"] = 3.0
    lines = [json.dumps(r) for r in rows]
    lines.insert(4, json.dumps({"prompt": "", "id": "empty"}))  # rejected: empty_prompt
    (folder / "part-0.jsonl").write_text("\n".join(lines[:5]) + "\n")
    (folder / "part-1.jsonl").write_text("\n".join(lines[5:]) + "\n")
    return str(folder / "*.jsonl")


# every score, with the built-in random scorers, in both engines' runs
SCORES = dict(scores=("clip", "aesthetic", "safety"), clip_model="tiny-clip", aesthetic_head="tiny-aesthetic",
              safety_checker="tiny-safety-checker")
SCORE_FLAGS = ["--score", "clip,aesthetic,safety", "--clip-model", "tiny-clip", "--aesthetic-head", "tiny-aesthetic",
               "--safety-checker", "tiny-safety-checker"]
SCORE_COLUMNS = ("clip_similarity", "aesthetic", "nsfw", "nsfw_score")


def beam_settings(prompts: str, out: str) -> Settings:
    """The settings ``promptmill run`` builds from the pod run's flags below."""
    return Settings(prompts=prompts, out=out, model="tiny", steps=STEPS, per_device_batch=1, batches_per_slice=2,
                    devices_per_host=2, **SCORES)


@contextlib.contextmanager
def captured_events():
    """The promptmill log events emitted inside the block, as dicts."""
    events: list[dict] = []

    class Handler(logging.Handler):
        def emit(self, record):
            events.append({"event": record.getMessage(), **getattr(record, "fields", {})})

    handler = Handler()
    logger = logging.getLogger(logs.LOGGER)
    logger.addHandler(handler)
    try:
        yield events
    finally:
        logger.removeHandler(handler)


def named(events: list[dict], name: str) -> list[dict]:
    return [e for e in events if e["event"] == name]


class TransientFault(RuntimeError):
    pass


@contextlib.contextmanager
def fault_once(slice_index: int):
    """The first attempt at slice ``slice_index`` fails inside the generate DoFn once its
    first image is stored, before the slice's other images, shards and commit marker.

    Patches ``SliceWriter.add`` in this process, where the in-process runners run the
    DoFn. Yields the list of keys at which it fired (at most one).
    """
    original = writer.SliceWriter.add
    fired: list[str] = []

    def add(self, item, *args, **kwargs):
        if self.index == slice_index and self._pending and not fired:
            self.wait_images()  # the first image is on disk: a half-written slice
            fired.append(item.key)
            raise TransientFault(f"injected transient failure in slice {slice_index} at {item.key}")
        return original(self, item, *args, **kwargs)

    writer.SliceWriter.add = add
    try:
        yield fired
    finally:
        writer.SliceWriter.add = original


def metadata_rows(out: str) -> dict[str, dict]:
    return {r["key"]: r for r in parts.dataset_rows(out)}


def image_hashes(out: str) -> dict[str, str]:
    return {key: hashlib.sha256(storage.read_bytes(naming.join(out, row["path"]))).hexdigest()
            for key, row in metadata_rows(out).items()}


def rejects(out: str) -> dict[str, str]:
    root = naming.rejects_dir(out)
    return {path[len(root):]: storage.read_text(path) for path in storage.glob(naming.join(root, "*.jsonl"))}


def comparable(row: dict) -> dict:
    """A metadata row without the run's own timestamp (``created_at``: when it was planned)
    and without the host that made it (a pod host's index, a beam worker's id)."""
    return {k: v for k, v in row.items() if k not in ("created_at", "host")}


def this_worker() -> int:
    """The ``host`` column of slices generated in this process (the in-process runners)."""
    return beam_worker.worker_id(socket.gethostname(), os.getpid())


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("beam-prompts"))


@pytest.fixture(scope="module")
def pod_started(prompts, tmp_path_factory, model_cache):
    """The pod engine's run (``promptmill run``, 1 host x 2 devices, the same settings),
    started in the background so that it runs while this process runs the beam engine."""
    from pipeline.model import load as model_lib

    model_lib.resolve("tiny")  # built once, before both engines need it
    folder = tmp_path_factory.mktemp("pod")
    out, log = str(folder / "out"), folder / "cli.log"
    command = [sys.executable, "-m", "jobs.cli", "run", "--prompts", prompts, "--out", out, "--model", "tiny",
               "--hosts", "1", "--devices-per-host", "2", "--steps", str(STEPS), "--per-device-batch", "1",
               "--batches-per-slice", "2", "--no-progress", *SCORE_FLAGS]
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, PROMPTMILL_CACHE=model_cache),
                                   stdout=sink, stderr=subprocess.STDOUT)
    yield out, process, log
    if process.poll() is None:  # not waited for (a test selection without pod_run): stop it and its host
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def pod_run(pod_started):
    out, process, log = pod_started
    assert process.wait(timeout=600) == 0, log.read_text()[-4000:]
    return out


@pytest.fixture(scope="module")
def beam_run(prompts, tmp_path_factory, model_cache, pod_started):
    """The clean beam run, on the default runner (the DirectRunner): (OUT, stats, events)."""
    out = str(tmp_path_factory.mktemp("beam") / "out")
    with captured_events() as events:
        stats = beam_engine.run_beam(beam_settings(prompts, out))
    return out, stats, events


def test_beam_engine_writes_the_pod_engines_images_metadata_and_rejects(beam_run, pod_run):
    out, stats, _ = beam_run
    assert stats["verified"] and (stats["images"], stats["records"], stats["rejects"]) == (9, 8, 1)
    beam_manifest, pod_manifest = (storage.read_json(naming.manifest(o)) for o in (out, pod_run))
    assert beam_manifest == pod_manifest and beam_manifest["slices"] == 3
    for index in range(3):
        assert storage.read_bytes(naming.plan_slice(out, index)) == storage.read_bytes(naming.plan_slice(pod_run, index))
    assert image_hashes(out) == image_hashes(pod_run) and len(image_hashes(out)) == 9
    beam_rows, pod_rows = metadata_rows(out), metadata_rows(pod_run)
    # every column, the scores included: each image scored on the devices that made it, alike in both engines
    assert {k: comparable(r) for k, r in beam_rows.items()} == {k: comparable(r) for k, r in pod_rows.items()}
    assert all(r[name] is not None for r in beam_rows.values() for name in SCORE_COLUMNS)
    assert {r["sha256"] for r in beam_rows.values()} == set(image_hashes(out).values())
    # the host column: the pod's host index, the id of the beam worker that generated the slice
    assert {r["host"] for r in pod_rows.values()} == {0}
    assert {r["host"] for r in beam_rows.values()} == {this_worker()}
    assert list(stats["hosts"]) == [str(this_worker())]
    assert rejects(out) == rejects(pod_run)
    [reject] = [json.loads(line) for text in rejects(out).values() for line in text.splitlines()]
    assert reject["reason"] == "empty_prompt" and reject["line"] == 5
    # padding rows (3 in the last slice) are never written
    assert len(storage.glob(naming.join(out, "images", "*", "*.png"))) == 9


def test_counters_events_and_nothing_recompiled(beam_run):
    out, stats, events = beam_run
    [generated] = named(events, "generated")
    assert generated == {"event": "generated", "slices_generated": 3, "images": 9}
    assert sorted(e["slice"] for e in named(events, "slice_committed")) == [0, 1, 2]
    # the DirectRunner hands the DoFn bundles of several slices, each run as one host loop
    bundles = [sorted(e["slices"]) for e in named(events, "bundle_generated")]
    assert sorted(i for b in bundles for i in b) == [0, 1, 2] and max(map(len, bundles)) > 1
    [planned] = named(events, "planned")
    assert (planned["records"], planned["rejects"], planned["rows_read"]) == (8, 1, 9)
    assert stats["compiles_after_warmup"] == 0 and stats["committed_slices"] == 3
    assert [storage.read_json(naming.shard_stats(out, i))["padding"] for i in range(3)] == [0, 0, 3]


def test_bundle_retry_in_the_runner_rewrites_the_half_written_slice(beam_run, prompts, tmp_path):
    """A real bundle retry. The FnApiRunner (the DirectRunner's batch engine) never
    retries a failed bundle: ``BundleManager._run_bundle`` raises ``RuntimeError(result.error)``
    (apache_beam/runners/portability/fn_api_runner/fn_runner.py; apache/beam#18640 "Support
    bundle retries in the FnApiRunner" is open). Beam's BundleBasedDirectRunner does
    retry: ``TransformExecutor.call`` re-runs a failed bundle up to 4 times with a fresh
    evaluator (runners/direct/executor.py, ``_MAX_RETRY_PER_BUNDLE``), discarding the
    failed attempt's outputs, as Dataflow does with a failed work item. So here the whole
    job runs on the BundleBasedDirectRunner, slice 1 fails once after storing one image,
    and the runner's retry must redo and commit it: the job succeeds, collect verifies
    every planned key exactly once, and the images and metadata equal the clean run's.
    Not shown: a retry on another worker process (it would load its own model; the
    outputs do not depend on it).
    """
    clean, _, _ = beam_run
    out = str(tmp_path / "out")
    with captured_events() as events, fault_once(1) as fired:
        stats = beam_engine.run_beam(beam_settings(prompts, out), ["--runner", "BundleBasedDirectRunner"])
    assert len(fired) == 1  # the fault happened, inside the pipeline that then succeeded
    [redone] = [e for e in named(events, "slice_redone") if e["slice"] == 1]
    assert redone["leftover_objects"] >= 1  # the retry found the failed attempt's image
    assert stats["verified"] and stats["images"] == 9 and stats["problems"] == {}
    assert image_hashes(out) == image_hashes(clean)
    assert ({k: comparable(r) for k, r in metadata_rows(out).items()}
            == {k: comparable(r) for k, r in metadata_rows(clean).items()})
    assert len(storage.glob(naming.join(out, "images", "*", "*.png"))) == 9


def test_without_runner_retries_the_job_fails_loudly_and_a_rerun_resumes(beam_run, prompts, tmp_path):
    """On the FnApiRunner a failed bundle fails the job (no retry, see above). Running the
    same job again, as Dataflow would retry the work, resumes: committed slices are
    skipped, the half-written slice 1 is redone, and the dataset equals the clean run's.
    This run also writes zarr (the worker opens the array once the plan has sized it):
    its rows hold the clean run's pixels."""
    clean, _, _ = beam_run
    out = str(tmp_path / "out")
    settings = beam_settings(prompts, out).replace(formats=("files", "zarr"))
    with fault_once(1) as fired, pytest.raises(Exception, match="injected transient failure in slice 1"):
        beam_engine.run_beam(settings, ["--runner", "FnApiRunner"])
    assert len(fired) == 1
    assert not writer.is_committed(out, 1) and writer.leftovers(out, settings, 1)
    assert not storage.exists(naming.dataset_file(out, "stats.json"))  # collect never started
    committed_before = {i for i in range(3) if writer.is_committed(out, i)}
    with captured_events() as events:
        stats = beam_engine.run_beam(settings, ["--runner", "FnApiRunner"])
    assert {e["slice"] for e in named(events, "slice_skipped")} == committed_before
    assert [e["slice"] for e in named(events, "slice_redone")] == [1]
    assert [e["slices"] for e in named(events, "plan_kept")] == [3]  # the plan had finished: kept
    assert {e["slice"] for e in named(events, "slice_committed")} == {0, 1, 2} - committed_before
    assert stats["verified"] and stats["images"] == 9
    assert image_hashes(out) == image_hashes(clean)
    assert len(storage.glob(naming.join(out, "images", "*", "*.png"))) == 9
    array = formats.read_zarr_images(out)
    assert array.shape == (9, 32, 32, 3)
    for key, row in metadata_rows(clean).items():
        with Image.open(io.BytesIO(storage.read_bytes(naming.join(clean, row["path"])))) as image:
            assert np.array_equal(array[row["position"]].read().result(), np.asarray(image)), key


def test_local_cpu_devices_reach_jax_in_a_fresh_process():
    """What ``run_beam`` does first on a local runner, in a process like the CLI's: jax
    (here imported already, its backend not started) then has the planned CPU devices."""
    code = ("import jax, jobs.cli; from pipeline.engines import beam as beam_engine; "
            "beam_engine.use_local_cpu_devices(3); print(len(jax.local_devices()), jax.local_devices()[0].platform)")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["3", "cpu"]


def run_bundle(fn, *indices) -> list:
    """One bundle through the DoFn as a runner drives it; its outputs, in order."""
    fn.start_bundle()
    outputs = [output for index in indices for output in fn.process(index)]
    return outputs + [windowed.value for windowed in fn.finish_bundle() or ()]


def same_slice_bytes(out: str, clean: str, index: int) -> int:
    """Asserts slice ``index``'s images and metadata shard in ``out`` are ``clean``'s, byte
    for byte; returns how many images it has."""
    images = sorted(p.rsplit("/", 1)[-1] for p in storage.glob(naming.join(naming.images_dir(out, index), "*.png")))
    assert images == sorted(p.rsplit("/", 1)[-1] for p in storage.glob(naming.join(naming.images_dir(clean, index),
                                                                                   "*.png")))
    for name in images:
        assert (storage.read_bytes(naming.join(naming.images_dir(out, index), name))
                == storage.read_bytes(naming.join(naming.images_dir(clean, index), name)))
    for path in (naming.shard_metadata, naming.thumb_pack):
        assert storage.read_bytes(path(out, index)) == storage.read_bytes(path(clean, index))
    return len(images)


def test_a_bundle_of_slices_fails_midway_and_its_retry_commits_the_same_bytes(beam_run, tmp_path):
    """One bundle holds all three slices, run as one overlapped host loop. Slice 1 fails
    midway (one image stored, no shards, no commit marker): the bundle fails, slice 0 is
    committed (its images were all written first), slice 1 is not. The retried bundle
    skips slice 0, regenerates 1 and 2, and every slice is byte for byte the clean run's."""
    clean, _, _ = beam_run
    out = str(tmp_path / "out")
    shutil.copytree(naming.join(clean, "plan"), naming.join(out, "plan"))
    shutil.copy(naming.run_json(clean), naming.run_json(out))  # same run: same created_at
    shutil.copy(naming.manifest(clean), naming.manifest(out))
    run = runs.read(out)
    fn = beam_worker.GenerateSlicesFn(out)
    fn.setup()
    with fault_once(1), pytest.raises(TransientFault):
        run_bundle(fn, 0, 1, 2)
    assert writer.is_committed(out, 0) and not writer.is_committed(out, 1)
    assert len(writer.leftovers(out, run.settings, 1)) == 1  # its first image (thumbnails are packed at commit)
    with captured_events() as events:
        outputs = run_bundle(fn, 0, 1, 2)
    assert outputs[0] == {"slice": 0, "skipped": True}
    assert [(o["slice"], o["images"], o["compiles_after_warmup"]) for o in outputs[1:]] == [(1, 4, 0), (2, 1, 0)]
    assert [e["slice"] for e in named(events, "slice_redone")][:1] == [1]
    assert [same_slice_bytes(out, clean, i) for i in range(3)] == [4, 4, 1]
    assert run_bundle(fn, 1) == [{"slice": 1, "skipped": True}]  # a retry after the commit skips it
    # the metadata's scores are exactly what the worker's scoring program gives the written
    # images with their prompts (whichever device and batch place each had)
    import jax

    generator, scorer = fn.worker.generator, fn.worker.scorer
    rows = sorted(writer.read_parquet_rows(naming.shard_metadata(out, 0)), key=lambda r: -r["position"])
    split = model_sharding.batch_sharding(model_sharding.mesh(generator.devices, 1), 4)  # as the sampler's images
    for start in range(0, len(rows), generator.batch_size):
        chunk = rows[start:start + generator.batch_size]
        images = np.stack([np.asarray(Image.open(io.BytesIO(storage.read_bytes(naming.join(out, r["path"])))))
                           for r in chunk])
        on_devices = jax.device_put(images, split)
        found = scorer.fetch(scorer.dispatch(on_devices, generator, scorer.tokenize([r["prompt"] for r in chunk])))
        for k, row in enumerate(chunk):
            assert tuple(row[name] for name in SCORE_COLUMNS) == tuple(found[name][k].item() for name in SCORE_COLUMNS)


def test_a_filtered_run_keeps_every_row_and_puts_no_dropped_image_in_any_output(beam_run, prompts, tmp_path):
    """--min-clip-similarity, --min-aesthetic and --drop-nsfw, with every format: each image
    a filter fails keeps its metadata row (its reason naming the rules and values) and is
    in no image output (no file, tar entry, image parquet row or thumbnail; zeros in zarr,
    beside a True in zarr's dropped array); the stats and the card count them by rule; the
    gallery shows the row without a picture; xarray opens OUT/zarr. Thresholds come from the
    clean run's scores (the same images, so the same scores), so each rule drops some."""
    import xarray

    from pipeline.core import filters

    clean, _, _ = beam_run
    clean_rows = metadata_rows(clean)
    clips = sorted(r["clip_similarity"] for r in clean_rows.values())
    aesthetics = sorted(r["aesthetic"] for r in clean_rows.values())
    assert 0 < sum(r["nsfw"] for r in clean_rows.values()) < 9  # the built-in checker flags some of these
    out = str(tmp_path / "out")
    settings = beam_settings(prompts, out).replace(formats=("files", "webdataset", "parquet", "zarr"),
                                                   min_clip_similarity=clips[2], min_aesthetic=aesthetics[1],
                                                   drop_nsfw=True)
    expected = {key: filters.dropped_reason(settings, {n: row[n] for n in SCORE_COLUMNS})
                for key, row in clean_rows.items()}
    dropped = {key for key, reason in expected.items() if reason}
    kept = set(clean_rows) - dropped
    by_rule = collections.Counter(rule for reason in expected.values() for rule in filters.rules_of(reason))
    assert kept and set(by_rule) == set(filters.RULES) and by_rule["min_clip_similarity"] == 2

    stats = beam_engine.run_beam(settings)
    assert stats["verified"] and stats["images"] == len(kept) and stats["records"] == 8
    assert stats["dropped"] == {"images": len(dropped), "by_rule": dict(sorted(by_rule.items()))}
    assert stats["image_conservation"] == {"planned_images": 9, "images": len(kept), "dropped": len(dropped),
                                           "holds": True}
    rows = metadata_rows(out)  # every planned image keeps its row: the same bytes and scores as unfiltered
    assert {k: r["dropped"] for k, r in rows.items()} == expected
    assert {k: (r["sha256"], *(r[n] for n in SCORE_COLUMNS)) for k, r in rows.items()} == \
        {k: (r["sha256"], *(r[n] for n in SCORE_COLUMNS)) for k, r in clean_rows.items()}
    assert {k for k, r in rows.items() if r["path"]} == kept
    keys_of = lambda paths: {p.rsplit("/", 1)[-1].split(".")[0] for p in paths}  # noqa: E731
    assert keys_of(storage.glob(naming.join(out, "images", "*", "*.png"))) == kept
    thumbs = set()
    for index in range(3):  # each slice's thumbnails, packed: none of a dropped image
        with tarfile.open(fileobj=io.BytesIO(storage.read_bytes(naming.thumb_pack(out, index)))) as pack:
            thumbs |= keys_of(pack.getnames())
    assert thumbs == kept
    members = set()
    for index in range(3):
        with tarfile.open(fileobj=io.BytesIO(storage.read_bytes(naming.shard_tar(out, index)))) as tar:
            members |= {name.split(".")[0] for name in tar.getnames()}
        members_parquet = writer.read_parquet_rows(naming.image_parquet(out, index))
        assert {r["key"] for r in members_parquet} == {k for k in kept if clean_rows[k]["slice"] == index}
    assert members == kept
    dataset = xarray.open_zarr(naming.join(out, "zarr"))
    assert dataset["images"].dims == ("image", "height", "width", "channel")
    assert dataset["dropped"].dims == ("image",) and dataset.sizes["image"] == 9
    flags = dataset["dropped"].values
    for key, row in rows.items():
        pixels = dataset["images"][row["position"]].values
        assert flags[row["position"]] == (key in dropped)
        if key in dropped:
            assert not pixels.any()
        else:
            with Image.open(io.BytesIO(storage.read_bytes(naming.join(out, row["path"])))) as image:
                assert np.array_equal(pixels, np.asarray(image))
    card = storage.read_text(naming.dataset_card(out))
    assert f"Dropped by the score filters: {len(dropped)} image(s)" in card and "| `drop_nsfw` |" in card
    assert "## Scores" in card and "| `clip_similarity` | 9 |" in card
    page = storage.read_text(naming.dataset_file(out, "index.html"))
    assert page.count('class="dropped"') == len(dropped) and page.count("<img ") == len(kept)


def test_a_worker_with_other_devices_than_planned_is_refused_before_loading(beam_run):
    out, _, _ = beam_run
    run = runs.read(out)
    run = dataclasses.replace(run, settings=run.settings.replace(devices_per_host=4))
    with pytest.raises(beam_worker.BeamEngineError, match=r"has 2 local cpu device\(s\), but the run was planned "
                                                          r"with --devices-per-host 4.*--devices-per-host 2"):
        beam_worker.Worker(run, out)


def test_worker_ids_are_stable_31_bit_and_tell_workers_apart():
    ids = {beam_worker.worker_id(machine, pid) for machine in ("wk-a", "wk-b", "promptmill-harness-0x1")
           for pid in (1, 2, 4096, 2**22)}
    assert len(ids) == 12 and all(0 <= i < 2**31 for i in ids)
    assert beam_worker.worker_id("wk-a", 7) == beam_worker.worker_id("wk-a", 7)


def test_compile_cache_is_on_before_the_worker_compiles(beam_run, tmp_path):
    """``--compile-cache`` for the beam engine: a worker built with it writes every
    program it compiles at warm-up into the folder (this process already compiled the
    run's programs for its own worker, but a new worker's generator compiles anew)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    from pipeline.generate import compile_cache

    out, _, _ = beam_run
    folder = str(tmp_path / "compile-cache")
    try:
        with captured_events() as events:
            for _ in range(2):  # the second as a restarted worker on the same machine
                beam_worker.Worker(runs.read(out), out, folder).pool.shutdown()
    finally:  # the rest of this process compiles without a persistent cache, as before
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()
        compile_cache.jax_cache.forget()
    cache = named(events, "compile_cache")
    cold, warm = named(events, "worker_ready")
    assert cache[0]["path"] == folder and cold["host"] == this_worker()
    assert cold["cache_writes"] >= 1 and compile_cache.entries(folder) >= 1
    # the sampler: compiled and kept by the first, found (not even traced) by the second
    assert not cold["sampler_from_cache"] and cold["sampler_lowered"]
    assert warm["sampler_from_cache"] and not warm["sampler_lowered"] and warm["load_s"] >= 0
    # the scoring program too (the run scores its images)
    assert not cold["scorer_from_cache"] and cold["scorer_lowered"]
    assert warm["scorer_from_cache"] and not warm["scorer_lowered"]


def test_cli_passes_compile_cache_to_the_beam_engine(monkeypatch, tmp_path):
    from jobs import cli

    seen = {}

    def fake_run_beam(settings, beam_args=None, overwrite=False, compile_cache=None, gallery=None):
        seen.update(out=settings.out, compile_cache=compile_cache, beam_args=beam_args)
        return {k: 0 for k in cli.SUMMARY}

    monkeypatch.setattr(beam_engine, "run_beam", fake_run_beam)
    out = str(tmp_path / "out")
    assert cli.main(["run", "--engine", "beam", "--prompts", "p.jsonl", "--out", out, "--model", "tiny",
                     "--compile-cache", "cc"]) == 0
    assert seen == {"out": out, "compile_cache": "cc", "beam_args": []}


def test_check_devices_and_the_collect_barrier():
    beam_worker.check_devices(4, 4)
    with pytest.raises(beam_worker.BeamEngineError, match="1 local tpu device.*--devices-per-host 8"):
        beam_worker.check_devices(1, 8, "tpu")
    manifest = {"slices": 3}
    with TestPipeline() as p:  # what the barrier gets: the generated slices, counted per slice, never listed
        found = p | beam.Create([2, 0, 5, 2, 1]) | plan.IndexSpan()
        assert_that(found, equal_to([plan.Span(4, 0, 5, 1, (2,))]))
    assert beam_engine.release_collect(plan.Span(3, 0, 2), manifest) == manifest
    assert beam_engine.release_collect(plan.Span(0, None, None), {"slices": 0}) == {"slices": 0}
    for span, message in ((plan.Span(2, 0, 2), r"2 distinct slice\(s\) from 0 to 2 for 3 planned, 0 more"),
                          (plan.Span(3, 0, 2, 1, (2,)), r"3 distinct .* 1 more than once \[2\]"),
                          (plan.Span(3, 1, 3), r"3 distinct slice\(s\) from 1 to 3 for 3 planned")):
        with pytest.raises(beam_worker.BeamEngineError, match=message):
            beam_engine.release_collect(span, manifest)


def test_the_generate_graph_holds_a_slice_count_not_the_slices(tmp_path):
    """``submit dataflow``'s TPU job for 15M slices (a billion images at 64 a slice) has a
    graph under 1 MB, as big as for 10 slices (a list of 15M numbers pickles to 10.8 MB, over
    Dataflow's 10 MB): it is built here, never run. Its slices are still every index once."""
    graph = {}
    for slices in (10, 15_000_000):
        p = beam.Pipeline()
        beam_engine.build_generate(p, str(tmp_path / "out"), slices)
        graph[slices] = len(p.to_runner_api().SerializeToString())
    assert graph[15_000_000] < 1 << 20 and abs(graph[15_000_000] - graph[10]) < 1024, graph
    with TestPipeline() as p:
        counted = p | beam.Create([2 * beam_engine.SLICES_PER_CHUNK + 3]) | beam_engine.SliceIndices()
        assert_that(counted, equal_to(list(range(2 * beam_engine.SLICES_PER_CHUNK + 3))))


@pytest.mark.parametrize("args, local", [
    ([], True), (["--runner", "DirectRunner"], True), (["--runner=direct"], True),
    (["--runner", "BundleBasedDirectRunner"], True), (["--runner", "FnApiRunner"], True),
    (["--runner", "apache_beam.runners.direct.direct_runner.BundleBasedDirectRunner"], True),
    (["--runner", "DataflowRunner", "--project", "p"], False), (["--runner", "dataflow"], False),
    (["--runner", "PortableRunner"], False),
])
def test_is_local_runner(args, local):
    assert beam_engine.is_local_runner(args) is local


def test_use_local_cpu_devices_sets_the_device_count_and_keeps_other_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=7")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # as the tests run; jax is already started with 2 devices
    beam_engine.use_local_cpu_devices(2)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=2"
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_run_engine_flags_are_checked_by_the_cli(tmp_path, model_cache):
    from tests.conftest import run_cli

    result = run_cli(["run", "--engine", "beam", "--hosts", "2", "--out", str(tmp_path / "out")], model_cache)
    assert result.returncode == 1 and "--hosts is for --engine pod" in result.stderr
    assert not os.path.exists(tmp_path / "out")  # refused before any work
