"""``promptmill bench pipeline``: does the host side keep up with the devices?

The same slices go through three loops, and the report gives images/s for each:

(a) ``generator``: the generator alone, one step queued ahead (as the host does), the
    images fetched to the host and dropped: the most the devices can give;
(b) ``pipeline_local`` / ``pipeline_gcs``: ``host_loop.run_slices`` over every slice, on a
    ``host_loop.WRITER_THREADS`` pool, to a local folder and (``gcs``) to a GCS emulator on
    127.0.0.1: tokenising, overlapped dispatch, PNG encoding, uploads, metadata shard
    and commit marker, exactly as a host runs them;
(c) ``sequential``: the seed notebook's way: generate a batch, wait for it, then turn
    each image into a PIL image and save it as PNG, one after another, no threads.

(b)/(a) near 1 means the host keeps up with the device; (b)/(c) is what the overlapped
pipeline buys over the seed loop. For (b), the summed ``input_s`` (tokenising),
``device_wait_s`` (waiting for a step) and ``output_s`` (handing images to the writer,
including backpressure, and finishing the slice) name the bottleneck: a host that keeps
up spends its time in ``device_wait_s``, and ``device_busy_fraction`` (the devices' busy
time, from when each step was dispatched and finished, over the wall time) is near 1.

The generator is either the real one on a model (``tiny``: the tiny random model, on
whatever devices JAX finds), or ``SyntheticGenerator``, which emulates a device that
takes a fixed time per step and returns fixed-size random-noise images (incompressible,
so PNG encoding and uploads cost what they cost on big images), to ask whether this
machine's cores keep up with a given device speed, e.g. 8 images of 512x512 a second.

A slice's shards and commit marker are written while the next slice runs, so only the
last slice's tail (its last batch's encoding, its shards) adds to (b); with few slices
that tail is a larger share of the run.

Peak RSS (``ru_maxrss``, a high-water mark) is recorded after each mode, and (b) also
records the RSS after each slice's commit; run with 10x ``slices`` to see whether either
grows with the run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline.bench.machine import cpu_model
from pipeline.core import logs, naming, records
from pipeline.core.settings import Run, Settings, check_size
from pipeline.io import gcs, runs, storage

BUCKET = "promptmill-pipeline-bench"
GUIDANCE = 7.5
CREATED_AT = "2026-01-01T00:00:00+00:00"
MODES = ("generator", "pipeline", "beam", "sequential")


class SyntheticGenerator:
    """A stand-in device: each step takes ``seconds_per_batch`` and returns the same
    ``batch_size`` random uint8 images of ``height`` x ``width`` (a fresh host copy each
    time, like a device-to-host transfer).

    Steps run one after another on one worker thread, like a device's queue, so
    ``dispatch`` returns at once and ``fetch`` waits. Duck-types what ``host_loop.run_slices``
    uses of ``pipeline.generate.generator.Generator``.
    """

    latents = False

    def __init__(self, batch_size: int, width: int, height: int, seconds_per_batch: float, seed: int = 0):
        if batch_size < 1 or width < 1 or height < 1 or seconds_per_batch < 0:
            raise ValueError("synthetic generator needs batch >= 1, width and height >= 1, seconds >= 0")
        self.batch_size, self.per_device_batch = batch_size, batch_size
        self.width, self.height, self.seconds_per_batch = width, height, seconds_per_batch
        self.devices = ["synthetic"]
        self.images = np.random.default_rng(seed).integers(0, 256, (batch_size, height, width, 3), np.uint8)
        self._device = ThreadPoolExecutor(1, thread_name_prefix="synthetic-device")

    def _step(self) -> np.ndarray:
        time.sleep(self.seconds_per_batch)
        return self.images.copy()

    def batch_of(self, rows):
        prompts = ["" if row is None else row[0] for row in rows]
        return tuple(prompts + [""] * (self.batch_size - len(prompts)))

    def truncated(self, prompts) -> list[bool]:
        return [False] * len(prompts)

    def dispatch(self, batch):
        if len(batch) != self.batch_size:
            raise ValueError(f"a batch holds {self.batch_size} images, got {len(batch)}")
        return self._device.submit(self._step)

    def wait(self, handle) -> None:
        handle.result()

    def fetch(self, handle) -> tuple[np.ndarray, None]:
        return handle.result(), None

    def generate(self, batch) -> tuple[np.ndarray, None]:
        return self.fetch(self.dispatch(batch))

    def close(self) -> None:
        self._device.shutdown(wait=True)


@dataclasses.dataclass(frozen=True)
class PipelineBenchConfig:
    generator: str = "synthetic"  # or "tiny"
    width: int | None = None  # None: 512 synthetic, the model's native size for tiny
    height: int | None = None
    batch: int = 8  # images per device step (tiny: devices x per-device batch)
    seconds_per_batch: float = 1.0  # synthetic only
    slices: int = 4
    batches_per_slice: int = 2
    steps: int = 2  # tiny only
    gcs: bool = False
    modes: tuple[str, ...] = MODES  # which of (a), (b), (b') and (c) to run
    workdir: str | None = None  # None: a temporary folder, deleted after
    report: str | None = None

    def validate(self) -> "PipelineBenchConfig":
        if self.generator not in ("synthetic", "tiny"):
            raise ValueError(f"--generator must be synthetic or tiny, got {self.generator!r}")
        if min(self.batch, self.slices, self.batches_per_slice, self.steps) < 1:
            raise ValueError("--batch, --slices, --batches-per-slice and --steps must be >= 1")
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"--modes must list some of {', '.join(MODES)}, got {','.join(self.modes)}")
        if self.seconds_per_batch < 0:
            raise ValueError("--seconds-per-batch must be >= 0")
        for name in ("width", "height"):
            if getattr(self, name) is not None:
                check_size(name, getattr(self, name), 8)
        return self


def bench_run(width: int, height: int, steps: int, per_device_batch: int, *, model: str = "synthetic",
              scheduler: str = "synthetic", fingerprint: str = "0" * 64, batches_per_slice: int = 2,
              devices_per_host: int = 1) -> Run:
    """The run the benchmark's slices belong to: PNG files only."""
    settings = Settings(width=width, height=height, steps=steps, guidance_scale=GUIDANCE, model=model,
                        scheduler=scheduler, per_device_batch=per_device_batch, batches_per_slice=batches_per_slice,
                        devices_per_host=devices_per_host, decode_batch=None)  # its Generator decodes whole batches
    return Run.create(settings, fingerprint, created_at=CREATED_AT, versions={})


def write_plan(out: str, run: Run, slices: int, size: int) -> list[list[records.Item]]:
    """Write ``slices`` full plan slices of ``size`` items (one image per record) and
    run.json under ``out`` (local or gs://), without the plan pipeline; returns the items."""
    all_items = []
    for index in range(slices):
        items = []
        for position in range(index * size, (index + 1) * size):
            record = records.Record(id=f"bench-{position:07d}", prompt=f"a lighthouse on a cliff at dusk, {position}",
                                    negative_prompt="", seed=position, num_images=1, guidance_scale=None,
                                    source="bench.jsonl", line=position + 1)
            items.extend(records.expand(record, position, size))
        storage.write_text(naming.plan_slice(out, index), "".join(json.dumps(i.to_json()) + "\n" for i in items))
        all_items.append(items)
    runs.write(out, run)
    return all_items


def _inputs(generator, chunk: list[records.Item]):
    return generator.batch_of([item.inputs(GUIDANCE) for item in chunk])


def _rss() -> dict:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        current = None
    return {"peak_rss_mib": round(peak, 1), "rss_mib": None if current is None else round(current, 1)}


def _result(images: int, seconds: float, **extra) -> dict:
    return {"images": images, "seconds": round(seconds, 4), "images_per_s": round(images / seconds, 4),
            **extra, **_rss()}


def run_generator_only(generator, plan: list[list[records.Item]]) -> dict:
    """(a): every batch dispatched (the next one before the current is fetched), fetched
    to the host, and dropped."""
    n = generator.batch_size
    chunks = [items[start:start + n] for items in plan for start in range(0, len(items), n)]
    watch = logs.Stopwatch()
    previous = None
    for chunk in chunks:
        handle = generator.dispatch(_inputs(generator, chunk))
        if previous is not None:
            generator.fetch(previous)
        previous = handle
    generator.fetch(previous)
    return _result(sum(map(len, chunks)), watch.seconds())


def run_pipeline(generator, out: str, run: dict, slices: int, size: int) -> dict:
    """(b): ``host_loop.run_slices`` over the slices, as a host runs them."""
    from pipeline.generate import host_loop

    rss_after_commit = []  # this process's RSS each time a slice is committed: flat if memory is bounded
    watch = logs.Stopwatch()
    with ThreadPoolExecutor(max_workers=host_loop.WRITER_THREADS, thread_name_prefix="writer") as pool:
        stats = host_loop.run_slices(host_loop.one_size(generator, run, size), out, range(slices), 0, pool,
                                     on_commit=lambda _: rss_after_commit.append(_rss()["rss_mib"]))
    seconds = watch.seconds()
    parts = {name: round(sum(s[name] for s in stats), 4) for name in ("input_s", "device_wait_s", "output_s")}
    parts["other_s"] = round(seconds - sum(parts.values()), 4)
    busy = sum(s["device_busy_s"] for s in stats)
    bottleneck = max(("input_s", "device_wait_s", "output_s"), key=parts.get)
    return _result(sum(s["images"] for s in stats), seconds, out=out, **parts, device_busy_s=round(busy, 4),
                   device_busy_fraction=round(busy / seconds, 4),
                   bottleneck="device" if bottleneck == "device_wait_s" else bottleneck.removesuffix("_s"),
                   slice_seconds=[s["seconds"] for s in stats], rss_after_commit_mib=rss_after_commit)


# generators that the beam mode's DoFn finds in this process (the DirectRunner runs it
# here), by token: a DoFn is pickled, and a device is not
_IN_PROCESS: dict[str, object] = {}


class _InProcessWorker:
    """``make_worker`` for ``GenerateSlicesFn``: the bench's own generator (no model load,
    no compile) and a writer pool, as the beam engine's worker holds them."""

    def __init__(self, token: str):
        self.token = token

    def __call__(self, run):
        import types

        from pipeline.generate import host_loop

        return types.SimpleNamespace(generator=_IN_PROCESS[self.token], model=None, compiles_at_warm=0, host=0,
                                     scorer=None,
                                     pool=ThreadPoolExecutor(host_loop.WRITER_THREADS, thread_name_prefix="writer"))


def run_beam(generator, out: str, slices: int) -> dict:
    """(b'): the beam engine's generate DoFn (``GenerateSlicesFn``) on the DirectRunner over
    the slices, on the same generator: one bundle's slices as one overlapped host loop.
    Images/s counts from the first slice's start to the last commit (the slices' own
    stats), so the runner's start-up is left out; its whole wall time is reported too."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.engines.beam_worker import GenerateSlicesFn

    token = uuid.uuid4().hex
    _IN_PROCESS[token] = generator
    results = os.path.join(tempfile.mkdtemp(prefix="promptmill-beam-bench-"), "stats")
    try:
        watch = logs.Stopwatch()
        with beam.Pipeline(options=PipelineOptions(["--runner", "DirectRunner"])) as p:
            _ = (p | beam.Create(list(range(slices)))
                 | beam.ParDo(GenerateSlicesFn(out, make_worker=_InProcessWorker(token)))
                 | beam.Map(json.dumps) | beam.io.WriteToText(results))
        wall = watch.seconds()
        stats = [json.loads(line) for path in storage.glob(results + "*") for line in
                 storage.read_text(path).splitlines()]
    finally:
        _IN_PROCESS.pop(token, None)
        shutil.rmtree(os.path.dirname(results), ignore_errors=True)
    stats.sort(key=lambda s: s["slice"])
    span = max(s["committed_ts"] for s in stats) - min(s["started_ts"] for s in stats)
    busy = sum(s["device_busy_s"] for s in stats)
    return _result(sum(s["images"] for s in stats), span, out=out, runner_wall_s=round(wall, 4),
                   device_busy_s=round(busy, 4), device_busy_fraction=round(busy / span, 4),
                   slice_seconds=[s["seconds"] for s in stats])


def run_sequential(generator, plan: list[list[records.Item]], folder: str) -> dict:
    """(c): the seed loop: generate a batch and wait, then numpy -> PIL -> PNG file for
    each image in turn, on this thread."""
    from PIL import Image

    n = generator.batch_size
    watch = logs.Stopwatch()
    images_done = 0
    for index, items in enumerate(plan):
        target = os.path.join(folder, naming.slice_name(index))
        os.makedirs(target, exist_ok=True)
        for start in range(0, len(items), n):
            chunk = items[start:start + n]
            images, _ = generator.generate(_inputs(generator, chunk))
            for item, image in zip(chunk, images):
                Image.fromarray(image).save(os.path.join(target, f"{item.key}.png"))
                images_done += 1
    return _result(images_done, watch.seconds(), out=folder)


def count_files(folder: str, ext: str = ".png") -> int:
    return sum(name.endswith(ext) for _, _, names in os.walk(folder) for name in names)


def _build_generator(config: PipelineBenchConfig):
    """(generator, width, height, run dict, setup info) for ``config``."""
    if config.generator == "synthetic":
        width, height = config.width or 512, config.height or 512
        generator = SyntheticGenerator(config.batch, width, height, config.seconds_per_batch)
        run = bench_run(width, height, 0, config.batch, batches_per_slice=config.batches_per_slice)
        return generator, width, height, run, {
            "device_images_per_s": round(config.batch / config.seconds_per_batch, 4)
            if config.seconds_per_batch else None}
    import jax

    from pipeline.generate.generator import Generator
    from pipeline.generate.spec import ProgramSpec
    from pipeline.model import load as model_lib

    devices = jax.local_devices()
    if config.batch % len(devices):
        raise ValueError(f"--batch {config.batch} is not a multiple of the {len(devices)} local devices")
    watch = logs.Stopwatch()
    model = model_lib.load("tiny", dtype="fp32")
    width, height = model.size(config.width, config.height)
    generator = Generator(model, ProgramSpec(width, height, config.steps, config.batch // len(devices)))
    generator.warm_up()
    run = bench_run(width, height, config.steps, generator.per_device_batch, model="tiny",
                    scheduler=model.sampler.choice, fingerprint=model.fingerprint,
                    batches_per_slice=config.batches_per_slice, devices_per_host=len(devices))
    return generator, width, height, run, {"devices": len(devices), "platform": devices[0].platform,
                                           "build_s": round(watch.seconds(), 3)}


@contextlib.contextmanager
def _gcs_bucket():
    """A fresh bucket on a GCS emulator (the one ``STORAGE_EMULATOR_HOST`` names, or one
    started here); yields its name."""
    from pipeline.testing import emulator

    context = contextlib.nullcontext() if os.environ.get("STORAGE_EMULATOR_HOST") else emulator.running(BUCKET)
    with context:
        bucket = f"{BUCKET}-{uuid.uuid4().hex[:8]}"
        gcs.client().create_bucket(bucket)
        yield bucket


def _ratio(top: dict | None, bottom: dict | None) -> float | None:
    if not top or not bottom:
        return None
    return round(top["images_per_s"] / bottom["images_per_s"], 4)


def command_line(config: PipelineBenchConfig) -> str:
    flags = {"--generator": config.generator, "--width": config.width, "--height": config.height,
             "--batch": config.batch, "--seconds-per-batch": config.seconds_per_batch if config.generator ==
             "synthetic" else None, "--steps": config.steps if config.generator == "tiny" else None,
             "--slices": config.slices, "--batches-per-slice": config.batches_per_slice,
             "--modes": None if tuple(config.modes) == MODES else ",".join(config.modes),
             "--workdir": config.workdir, "--report": config.report}
    words = ["promptmill bench pipeline"] + [f"{k} {v}" for k, v in flags.items() if v is not None]
    return " ".join(words + (["--gcs"] if config.gcs else []))


def run(config: PipelineBenchConfig) -> dict:
    """Run (a), (b) local, (b) GCS if asked, and (c) on the same slices; returns the
    report (and writes it to ``config.report``)."""
    from pipeline.generate import host_loop

    config.validate()
    generator, width, height, run_dict, setup = _build_generator(config)
    size = generator.batch_size * config.batches_per_slice
    workdir = config.workdir or tempfile.mkdtemp(prefix="promptmill-pipeline-bench-")
    os.makedirs(workdir, exist_ok=True)
    modes = {}
    try:
        local = os.path.join(workdir, "local")
        plan = write_plan(local, run_dict, config.slices, size)
        rss_before = _rss()
        if "generator" in config.modes:
            modes["generator"] = run_generator_only(generator, plan)
            logs.event("bench_pipeline_mode", mode="generator", images_per_s=modes["generator"]["images_per_s"])
        if "pipeline" in config.modes:
            modes["pipeline_local"] = run_pipeline(generator, local, run_dict, config.slices, size)
            modes["pipeline_local"]["files"] = count_files(os.path.join(local, "images"))
            logs.event("bench_pipeline_mode", mode="pipeline_local",
                       images_per_s=modes["pipeline_local"]["images_per_s"])
        if config.gcs and "pipeline" in config.modes:
            with _gcs_bucket() as bucket:
                out = f"gs://{bucket}/pipeline-bench"
                write_plan(out, run_dict, config.slices, size)
                modes["pipeline_gcs"] = run_pipeline(generator, out, run_dict, config.slices, size)
                modes["pipeline_gcs"]["files"] = sum(1 for _ in storage.files(naming.join(out, "images"), "*/*.png"))
            logs.event("bench_pipeline_mode", mode="pipeline_gcs", images_per_s=modes["pipeline_gcs"]["images_per_s"])
        if "beam" in config.modes:
            beam_out = os.path.join(workdir, "beam")
            write_plan(beam_out, run_dict, config.slices, size)
            modes["beam_local"] = run_beam(generator, beam_out, config.slices)
            modes["beam_local"]["files"] = count_files(os.path.join(beam_out, "images"))
            logs.event("bench_pipeline_mode", mode="beam_local", images_per_s=modes["beam_local"]["images_per_s"])
        if "sequential" in config.modes:
            sequential = os.path.join(workdir, "sequential")
            modes["sequential"] = run_sequential(generator, plan, sequential)
            modes["sequential"]["files"] = count_files(sequential)
            logs.event("bench_pipeline_mode", mode="sequential", images_per_s=modes["sequential"]["images_per_s"])
    finally:
        if hasattr(generator, "close"):
            generator.close()
        if config.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    ratios = {f"{b}_over_{a}": _ratio(modes.get(b), modes.get(a))
              for b in ("pipeline_local", "pipeline_gcs", "beam_local") for a in ("generator", "sequential")}
    report = {"command": command_line(config),
              "config": {**dataclasses.asdict(config), "modes": list(config.modes), "width": width, "height": height,
                         "batch_size": generator.batch_size, "slice_size": size,
                         "images_per_mode": size * config.slices, "writer_threads": host_loop.WRITER_THREADS},
              "setup": setup, "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model()},
              "rss_before_modes": rss_before, "modes": modes, "ratios": ratios,
              "peak_rss_mib": _rss()["peak_rss_mib"]}
    if config.report:
        storage.write_json(config.report, report)
    return report


def table(report: dict) -> str:
    c = report["config"]
    device = (f"synthetic device, {c['seconds_per_batch']} s per batch" if c["generator"] == "synthetic"
              else f"tiny model, {c['steps']} steps")
    lines = [f"{c['images_per_mode']} images ({c['slices']} slices x {c['batches_per_slice']} batches of "
             f"{c['batch_size']}) at {c['width']}x{c['height']} PNG, {device}, "
             f"{report['machine']['cpu_count']} cores",
             f"{'mode':<15} {'images/s':>9} {'seconds':>8} {'input_s':>8} {'wait_s':>8} {'output_s':>9} "
             f"{'bottleneck':>10} {'busy':>5} {'peak RSS MiB':>12}"]
    for name, m in report["modes"].items():
        lines.append(f"{name:<15} {m['images_per_s']:>9.3f} {m['seconds']:>8.2f} {m.get('input_s', '-'):>8} "
                     f"{m.get('device_wait_s', '-'):>8} {m.get('output_s', '-'):>9} {m.get('bottleneck', '-'):>10} "
                     f"{m.get('device_busy_fraction', '-'):>5} {m['peak_rss_mib']:>12}")
    ratios = []
    names = {"pipeline_": "(b) ", "beam_": "(b') beam "}
    for name, value in report["ratios"].items():
        if value is not None:
            for prefix, label in names.items():
                name = name.replace(prefix, label)
            ratios.append(f"{name} = {value:.3f}")
    lines.append("  ".join(ratios))
    return "\n".join(lines)
