"""``run --engine beam``: the whole job as one Beam pipeline, each worker on its own devices.

Dataflow runs only single-host TPU workers, so this engine needs no ``jax.distributed``:
every worker process loads the model once and generates whole slices on its local
devices, with the same generator, host loop, writers and collect code as the pod engine.
Given the same settings and per-device batch, both engines write byte-identical images.

  Plan            ``pipeline.plan.transforms.Plan``: prompt files -> slices -> the manifest
                  (one element)
  Slices          the manifest's slice count -> its slice indices, spread over the workers
                  (``SliceIndices``: the count in chunks, each chunk enumerated by a worker)
  Generate        ``GenerateSlicesFn``: the model, loaded once per worker process in ``setup``; per
                  slice, a committed slice is skipped (resume), any other is generated,
                  written and committed by ``host_loop.run_slices``; emits the slice's stats
  AllGenerated    the generated slice indices, counted per index and combined
                  (``plan.IndexSpan``: no worker lists them)
  Barrier         once every slice has come out of Generate exactly once, i.e. every slice
                  is committed (``release_collect``): the manifest, released to collect
  Collect         ``pipeline.collect.transforms.Collect``, the same transform ``run_collect``
                  runs (its parts, key index, gallery and stats, in parallel): the
                  manifest -> the dataset and its stats

Before the pipeline, ``pipeline.plan.prepare.prepare`` resolves the settings and writes
``run.json``, as for ``run_plan``; after it, ``collect.check_verified`` raises on a
dataset that does not match the plan, as for ``run_collect``.

Retries are harmless: every object name and byte is deterministic and a slice's commit
marker is written last, so a retried slice rewrites the same bytes and commits, and a
retry of a committed slice skips it. (The Python FnApiRunner, the DirectRunner's batch
engine, does not retry a failed bundle: the job fails and a re-run resumes. Dataflow
and the BundleBasedDirectRunner retry the bundle.)

The metadata's ``host`` column (and the slice's ``_stats.json``, and so stats.json's
``hosts``) holds the id of the worker process that generated the slice
(``worker_id``: a 31-bit hash of its machine's name and process id, logged with both on
``worker_ready``). Images and their sha256 never depend on it; a slice redone on another
worker carries that worker's id in its metadata rows, as a pod run resumed with
another ``--hosts`` carries the new host indices.

``compile_cache`` (``--compile-cache``): each worker process turns JAX's persistent
compilation cache on before it compiles, so a worker of a later run loads the compiled
programs instead of compiling them (``pipeline.generate.compile_cache``; a ``gs://``
folder is mirrored, and what a worker adds is uploaded after its warm-up).

Locally the engine runs on a local runner (DirectRunner by default) with
``settings.devices_per_host`` CPU devices, like one host of the local pod engine. On
Dataflow the worker's local devices must number ``settings.devices_per_host``, since the
slice size depends on it; ``setup`` checks this. Counters (namespace ``generate``):
slices_generated, slices_skipped, slices_redone, images.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils import shared
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import WindowedValue

from pipeline.collect import transforms as collect
from pipeline.core import buckets, logs, naming, slicing
from pipeline.core.settings import Run, Settings
from pipeline.generate import compile_cache as cache_lib
from pipeline.generate import bucket_programs, environment, fit, host_loop, jax_events, runtime, scoring
from pipeline.io import beamio, ledgers, runs, storage
from pipeline.model.layers.attention import check_platform
from pipeline.plan import transforms as plan
from pipeline.plan.prepare import prepare

# Runners that run the DoFns on this machine (Beam's LOCAL_RUNNERS, and Prism, which the
# DirectRunner may hand the pipeline to): their workers get local CPU devices.
LOCAL_RUNNERS = ("DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner", "FnApiRunner",
                 "PrismRunner", "TestDirectRunner")


class BeamEngineError(RuntimeError):
    pass


def runner_name(beam_args: list[str] | None) -> str | None:
    """The ``--runner`` of ``beam_args`` (its class name), or None when none is given."""
    runner = PipelineOptions(list(beam_args or [])).view_as(StandardOptions).runner
    if runner is None:
        return None
    return runner if isinstance(runner, str) else type(runner).__name__


def is_local_runner(beam_args: list[str] | None) -> bool:
    """Whether the pipeline's DoFns run on this machine (no --runner: the DirectRunner)."""
    name = runner_name(beam_args)
    if name is None:
        return True
    name = name.rsplit(".", 1)[-1].lower()
    return any(name in (local.lower(), local.lower().removesuffix("runner")) for local in LOCAL_RUNNERS)


def use_local_cpu_devices(devices: int) -> None:
    """Give this process, and the worker processes it starts, ``devices`` CPU devices.

    Sets ``XLA_FLAGS`` (``--xla_force_host_platform_device_count``) and
    ``JAX_PLATFORMS=cpu`` in ``os.environ``, as ``engines.local.host_env`` does for a host
    process of the local pod engine. JAX reads them when its backend starts, so this must
    run before anything in the process asks JAX for devices; if jax is already imported,
    its platform setting is updated too. A backend already started with another device
    count is caught by the DoFn's device check.
    """
    from pipeline.engines import local

    env = local.host_env(devices, dict(os.environ))
    os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]
    os.environ["JAX_PLATFORMS"] = env["JAX_PLATFORMS"]
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")


def check_devices(found: int, wanted: int, platform: str = "") -> None:
    """Raise BeamEngineError unless the worker has the ``devices_per_host`` the run was planned for."""
    if found != wanted:
        where = f" {platform}" if platform else ""
        raise BeamEngineError(
            f"this worker has {found} local{where} device(s), but the run was planned with --devices-per-host "
            f"{wanted} (the slice size depends on it): plan with --devices-per-host {found}, or run on workers "
            f"with {wanted} devices (locally the engine sets XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{wanted} itself, unless JAX already started in this process)")


def release_collect(span: plan.Span, manifest: dict) -> dict:
    """The barrier between generate and collect (pure): every planned slice came out of
    Generate (committed, or found committed) exactly once (``span``: what ``plan.IndexSpan``
    counted of them); returns the manifest, for collect."""
    if not span.exactly(manifest["slices"]):
        raise BeamEngineError(f"generate emitted {span.describe(manifest['slices'])}")
    return manifest


def worker_id(machine: str, pid: int) -> int:
    """The ``host`` column of the slices a worker process generates (pure): a 31-bit
    hash of its machine's name and its process id, the same for the process's life."""
    return zlib.crc32(f"{machine}:{pid}".encode()) & 0x7FFFFFFF


class _Worker:
    """One worker process's model, compiled generator and writer threads.

    Built once per process (and per ``runtime.program_tag``) through ``_SHARED`` and
    shared by every DoFn instance and thread of the process, and by later pipelines in it.
    With ``compile_cache``, JAX's persistent compilation cache is on before anything compiles.
    """

    def __init__(self, run: Run, out: str, compile_cache: str | None = None, base: "_Worker | None" = None):
        """``base``: the worker of another size of the same run, whose model and weights on
        the devices this one shares (a run of several sizes: one program each)."""
        import jax

        if compile_cache:  # first: every program this worker compiles should go through the cache
            cache_dir = cache_lib.enable(compile_cache)
            logs.event("compile_cache", pid=os.getpid(), path=cache_dir)
        devices = jax.local_devices()
        check_devices(len(devices), run.settings.devices_per_host, devices[0].platform if devices else "")
        watch = logs.Stopwatch()
        machine = socket.gethostname()
        self.host = worker_id(machine, os.getpid())
        # as a pod host gets ready: the files checked against the plan's table, the sampler
        # made (or found in the executable cache) on a thread while the weights load
        if base is None:
            self.model, self.generator, parts = runtime.ready_generator(run, out, devices)
        else:
            program = runtime.compile_run_sampler(run.settings, devices)
            self.model, parts = base.model, {"compile": program.seconds}
            self.generator = runtime.make_generator(base.model, run.settings, devices, program, base.generator.params)
        # None without --score; another size's worker's scorer models are shared
        self.scorer, scorer_parts = scoring.ready_scorer(run, devices, like=base.scorer if base else None)
        parts.update(scorer_parts)
        self.compiles_at_warm = scoring.warm_up(self.generator, self.scorer)
        cache_stats = ({"cache_hits": jax_events.CACHE.count(jax_events.CACHE_HIT)
                        + cache_lib.EXECUTABLE_COUNTS["hits"],
                        "cache_writes": jax_events.CACHE.count(jax_events.CACHE_WRITE)
                        + cache_lib.EXECUTABLE_COUNTS["writes"],
                        "sampler_from_cache": self.generator.from_cache,
                        "sampler_lowered": self.generator.sampler_lowered,
                        **scoring.cache_stats(self.scorer)} if compile_cache else {})
        cache_stats.update({f"{k}_s": round(v, 3) for k, v in parts.items()})
        self.pool = ThreadPoolExecutor(max_workers=host_loop.WRITER_THREADS, thread_name_prefix="writer")
        logs.event("worker_ready", host=self.host, machine=machine, pid=os.getpid(), devices=len(devices),
                   platform=devices[0].platform, seconds=round(watch.seconds(), 2),
                   **({"size": f"{run.settings.width}x{run.settings.height}"} if base is not None else {}),
                   **cache_stats)
        if compile_cache:
            uploaded = cache_lib.push()
            if uploaded:
                logs.event("compile_cache_pushed", host=self.host, entries=uploaded)


_SHARED = shared.Shared()  # per process: the _Worker every DoFn instance of the process uses


_END = object()  # the end of a bundle's slices, for ``_BundleRun``'s queue


class _BundleRun:
    """One bundle's slices through ``host_loop.run_slices`` on a thread of its own, so
    that batches and commits overlap across the bundle's slices exactly as on a pod host:
    the next slice's first batch is dispatched before the previous slice's last batch is
    fetched, and a slice commits while the next one runs.

    ``add`` queues a slice; ``finished`` hands over the stats of the slices committed so
    far; ``close`` waits for the rest and re-raises a failure of the thread.
    """

    def __init__(self, worker, out: str, run: Run, size: int, host: int, *, zarr_arrays, zarr_group: str = "",
                 zarr_offset: int = 0):
        self.slots: queue.Queue = queue.Queue()
        self.committed: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.added: list[int] = []  # the slices queued, in order
        sizes = host_loop.one_size(worker.generator, run, size, scorer=worker.scorer, zarr_arrays=zarr_arrays,
                                   zarr_group=zarr_group, zarr_offset=zarr_offset)

        def work():
            try:
                host_loop.run_slices(sizes, out, self._slots(), host, worker.pool,
                                     compiles_at_warm=worker.compiles_at_warm, on_commit=self.committed.put)
            except BaseException as e:  # noqa: BLE001 (handed to the DoFn's thread, which raises it)
                self.error = e

        self.thread = threading.Thread(target=work, name="bundle-slices", daemon=True)
        self.thread.start()

    def _slots(self):
        while (index := self.slots.get()) is not _END:
            yield index

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def add(self, index: int) -> None:
        self._raise()
        self.added.append(index)
        self.slots.put(index)

    def finished(self) -> list[dict]:
        done = []
        while not self.committed.empty():
            done.append(self.committed.get())
        return done

    def close(self) -> list[dict]:
        self.slots.put(_END)
        self.thread.join()
        self._raise()
        return self.finished()


class GenerateSlicesFn(beam.DoFn):
    """Generates, writes and commits the slices (slice indices) of a bundle; skips a
    committed slice. Emits each slice's stats (``{"slice", "skipped": True}`` when skipped).

    The slices of a bundle run as one host loop (``_BundleRun``): ``process`` queues a
    slice and emits the stats of those committed so far, ``finish_bundle`` waits for the
    rest and emits theirs. With one slice per bundle, that slice pays its own tail (its
    last batch's encoding and its commit, with the devices idle), as every slice did
    before; with many, only the bundle's last slice does. A failed bundle leaves its
    slices uncommitted from the failed one on (a slice commits only after its images);
    the runner's retry skips the committed ones and regenerates the others, byte for byte.
    """

    def __init__(self, out: str, compile_cache: str | None = None, make_worker=None):
        self.out, self.compile_cache = out, compile_cache
        # make_worker(run) -> the worker (default: the model loaded once per process, _Worker);
        # the pipeline bench passes its own device
        self.make_worker = make_worker
        self.run = self.worker = None  # read from OUT on the first slice (``_ready``); worker: the first size's
        self.workers: dict[int, object] = {}  # by size index (one in a single-size run)
        self.bundles: dict[int, _BundleRun] = {}  # the bundle's slices of each size
        self.geometry = None
        self.generated = Metrics.counter("generate", "slices_generated")
        self.skipped = Metrics.counter("generate", "slices_skipped")
        self.redone = Metrics.counter("generate", "slices_redone")
        self.images = Metrics.counter("generate", "images")
        self._zarr: dict[int, tuple] = {}
        self._zarr_lock = threading.Lock()

    def setup(self):
        logs.setup()
        beamio.use_emulator_credentials()

    def _ready(self, index: int):
        """The run and its plan's sizes, read on the first slice (only then does run.json hold
        the plan's decisions: ``pipeline.plan.decide``), and the worker of slice ``index``'s
        size, built when a slice of that size first comes."""
        if self.run is None:
            run = runs.read(self.out)  # every worker makes the images in the run's environment, which rows name
            self.run = dataclasses.replace(run, environment=environment.establish(
                self.out, environment.current(), "a Beam worker"))
            settings = self.run.settings
            if settings.sizes:  # a single-size run's slices are all of one size (and read no manifest here)
                self.geometry = buckets.Geometry.of_manifest(storage.read_json(naming.manifest(self.out)),
                                                             settings.width, settings.height,
                                                             settings.per_device_batch)
        worker = self._worker(self._bucket_of(index))
        self.worker = self.worker or worker  # the first built

    def _bucket_of(self, index: int) -> int:
        return 0 if self.geometry is None else self.geometry.bucket_of_slice(index)

    def _slice_size(self, bucket: int) -> int:
        return self.run.settings.slice_size if self.geometry is None else self.geometry.buckets[bucket].slice_size

    def _worker(self, bucket: int):
        """The worker of size ``bucket`` (a run of several sizes has one program per size;
        the later sizes' workers share the first one's model and weights)."""
        if bucket not in self.workers:
            run = bucket_programs.bucket_run(self.run, bucket)
            if self.make_worker is not None:
                worker = self.make_worker(run)
            else:
                base = next(iter(self.workers.values()), None)
                worker = _SHARED.acquire(lambda: _Worker(run, self.out, self.compile_cache, base),
                                         runtime.program_tag(run))
            slicing.batches_per_slice(self._slice_size(bucket), len(worker.generator.devices),
                                      run.settings.per_device_batch)
            self.workers[bucket] = worker
        return self.workers[bucket]

    def _zarr_arrays(self, bucket: int):
        """(images, latents) zarr arrays of size ``bucket``, or (None, None); opened on first
        use, once the manifest (their shape) exists."""
        with self._zarr_lock:
            if "zarr" not in self.run.settings.formats:
                return None, None
            if bucket not in self._zarr:
                run = bucket_programs.bucket_run(self.run, bucket)
                if self.geometry is None:
                    count, group = storage.read_json(naming.manifest(self.out))["images"], ""
                else:
                    count, group = self.geometry.buckets[bucket].images, self.geometry.buckets[bucket].name
                self._zarr[bucket] = runtime.open_zarr(self.out, run, self.workers[bucket].model, count, group=group)
            return self._zarr[bucket]

    def start_bundle(self):
        self._wind_up()

    def teardown(self):
        self._wind_up()

    def _wind_up(self) -> None:
        """Let the slices of a bundle that failed before ``finish_bundle`` finish (or fail)
        before anything else runs, so that no two loops of this process ever write one
        slice; what they commit, a retry skips."""
        bundles, self.bundles = self.bundles, {}
        for bundle in bundles.values():
            try:
                bundle.close()
            except Exception as e:  # the failed bundle already failed: only say so
                logs.event("bundle_wound_up", level=logging.WARNING, error=f"{type(e).__name__}: {e}")

    def _emit(self, stats: dict) -> dict:
        self.generated.inc()
        self.images.inc(stats["images"])
        logs.event("slice_committed", pid=os.getpid(), **stats)
        return stats

    def process(self, index: int):
        self._ready(index)
        decision = runtime.decide(self.out, self.run.settings, index)
        if decision.action == "skip":
            self.skipped.inc()
            logs.event("slice_skipped", slice=index)
            yield {"slice": index, "skipped": True}
            return
        if decision.action == "redo":
            self.redone.inc()
            logs.event("slice_redone", slice=index, leftover_objects=decision.leftover_objects)
        bucket = self._bucket_of(index)
        if bucket not in self.bundles:
            worker = self._worker(bucket)
            group, offset = ("", 0) if self.geometry is None else (self.geometry.buckets[bucket].name,
                                                                   self.geometry.buckets[bucket].offset)
            self.bundles[bucket] = _BundleRun(worker, self.out, bucket_programs.bucket_run(self.run, bucket),
                                              self._slice_size(bucket), worker.host,
                                              zarr_arrays=self._zarr_arrays(bucket), zarr_group=group,
                                              zarr_offset=offset)
        self.bundles[bucket].add(index)
        for stats in self.bundles[bucket].finished():
            yield self._emit(stats)

    def finish_bundle(self):
        bundles, self.bundles = self.bundles, {}
        for bundle in bundles.values():
            watch = logs.Stopwatch()
            for stats in bundle.close():
                yield WindowedValue(self._emit(stats), MIN_TIMESTAMP, [GlobalWindow()])
            logs.event("bundle_generated", pid=os.getpid(), slices=bundle.added,
                       waited_s=round(watch.seconds(), 3))


def build(p, settings: Settings, run: Run, *, thumbnails: bool = True, compile_cache: str | None = None,
          cap_hosts: int | None = None, gallery: dict | None = None, kept: dict | None = None):
    """The whole job on ``p`` for resolved ``settings`` and ``run`` (run.json in force);
    returns the PCollection of stats.json's content. ``compile_cache``: a folder checked
    by ``compile_cache.resolve``; ``cap_hosts``: see ``plan.Plan``; ``gallery``: collect's
    options (``collect.Collect``'s page_size, gallery_max, gallery_order, part_rows);
    ``kept``: the manifest of a finished plan that a resumed run keeps (``plan.kept_plan``),
    which then is not planned again."""
    out = settings.out
    if kept is not None:
        manifest = p | "KeptPlan" >> beam.Create([kept])
    else:
        manifest = p | "Plan" >> plan.Plan(settings, cap_hosts)
    generated = (manifest
                 | "SliceCount" >> beam.Map(lambda m: m["slices"])
                 | "Slices" >> SliceIndices()
                 | "Generate" >> beam.ParDo(GenerateSlicesFn(out, compile_cache)))
    span = (generated
            | "SliceIndices" >> beam.Map(lambda stats: stats["slice"])
            | "AllGenerated" >> plan.IndexSpan())
    released = manifest | "Barrier" >> beam.Map(
        lambda m, found: release_collect(found, m), beam.pvalue.AsSingleton(span, default_value=plan.NO_SPAN))
    return released | "Collect" >> collect.Collect(out, run, thumbnails=thumbnails, **(gallery or {}))


def build_generate(p, out: str, slices: int):
    """Only the Generate step, on ``p``, for the ``slices`` slices already planned in ``out``
    (run.json and the manifest written): what ``submit dataflow`` runs as its TPU job, between
    a plan job and a collect job on CPU workers. Returns the PCollection of slice stats.
    The same DoFn as ``build``, so resume, retries and bytes are the same as there. The job's
    graph holds the count, not the slices (``SliceIndices``): Dataflow refuses a graph over
    10 MB, which a list of 15M slice numbers is."""
    return (p
            | "SliceCount" >> beam.Create([slices])
            | "Slices" >> SliceIndices()
            | "Generate" >> beam.ParDo(GenerateSlicesFn(out)))


SLICES_PER_CHUNK = 4096  # slice numbers one worker enumerates from a chunk


def _chunks(count: int):
    return ((start, min(start + SLICES_PER_CHUNK, count)) for start in range(0, count, SLICES_PER_CHUNK))


def _indices(chunk: tuple[int, int]):
    return range(*chunk)


class SliceIndices(beam.PTransform):
    """A slice count (one element) -> the slice numbers 0 .. count-1, spread over the
    workers: the count is cut into chunks, the chunks are spread, each worker enumerates its
    own, and the numbers are spread again. Nothing in the job's graph grows with the count,
    and no worker enumerates every slice."""

    def expand(self, count):
        return (count
                | "Chunks" >> beam.FlatMap(_chunks)
                | "SpreadChunks" >> beam.Reshuffle()
                | "Indices" >> beam.FlatMap(_indices)
                | "SpreadSlices" >> beam.Reshuffle())


def counters(result, namespace: str) -> dict:
    """The committed Beam counters of ``namespace`` of a finished pipeline, by name."""
    from apache_beam.metrics.metric import MetricsFilter

    totals: dict[str, int] = {}
    for counter in result.metrics().query(MetricsFilter().with_namespace(namespace))["counters"]:
        totals[counter.key.metric.name] = totals.get(counter.key.metric.name, 0) + counter.committed
    return dict(sorted(totals.items()))


def run_beam(settings: Settings, beam_args: list[str] | None = None, overwrite: bool = False,
             gallery_thumbnails: bool = True, compile_cache: str | None = None, gallery: dict | None = None) -> dict:
    """plan -> generate -> collect as one Beam pipeline; returns the dataset stats.

    ``beam_args`` are Beam's PipelineOptions (``--runner DataflowRunner ...``; none: the
    DirectRunner). With a local runner, this process and its workers get
    ``settings.devices_per_host`` CPU devices (``use_local_cpu_devices``). ``overwrite``
    deletes an earlier run in OUT first; without it a re-run resumes: committed slices
    are skipped. ``compile_cache`` (``--compile-cache``): every worker's persistent
    compilation cache folder, local (made absolute; on a remote runner, a folder on
    each worker) or ``gs://``. Raises ``collect.CollectError`` when the dataset does not
    match the plan.
    """
    watch = logs.Stopwatch()
    compile_cache = cache_lib.resolve(compile_cache) if compile_cache else None
    if is_local_runner(beam_args):
        use_local_cpu_devices(settings.devices_per_host)
        check_platform(settings.attention, "cpu")
    # workers come and go, so the batch is capped for one worker's devices
    cap = fit.cap_hosts(settings, 1, overwrite)
    settings = fit.resolve_per_device_batch(settings, overwrite)
    resuming = not overwrite and runs.exists(settings.out)
    settings, run = prepare(settings, overwrite)
    kept = plan.kept_plan(settings.out) if resuming else None
    ledgers.forget(settings.out)  # its workers keep none: status and a later pod run list the markers
    logs.event("beam_engine_started", out=settings.out, runner=runner_name(beam_args) or "DirectRunner",
               devices_per_host=settings.devices_per_host, batches_per_slice=settings.batches_per_slice)
    p = beam.Pipeline(options=PipelineOptions(list(beam_args or [])))
    build(p, settings, run, thumbnails=gallery_thumbnails, compile_cache=compile_cache, cap_hosts=cap, gallery=gallery,
          kept=kept)
    result = p.run()
    result.wait_until_finish()
    manifest = storage.read_json(naming.manifest(settings.out))
    logs.event("planned", records=manifest["records"], images=manifest["images"], rejects=manifest["rejects"],
               slices=manifest["slices"], slice_size=manifest["slice_size"], **buckets.planned_sizes(manifest),
               **counters(result, "plan"))
    logs.event("generated", **counters(result, "generate"))
    stats = storage.read_json(naming.dataset_file(settings.out, "stats.json"))
    logs.event("collected", images=stats["images"], rejects=stats["rejects"], verified=stats["verified"],
               seconds=round(watch.seconds(), 2), dataset=naming.join(settings.out, "dataset"))
    collect.warn_if_all_dropped(stats)
    collect.check_verified(stats)
    return stats
