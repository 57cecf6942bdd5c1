"""The beam engine's Generate step: a worker process's model, loaded once, and the bundles of
slices it generates (``pipeline.engines.beam`` composes the step into the job).

``GenerateSlicesFn`` is the DoFn: per slice, a committed slice is skipped (resume), any
other is generated, written and committed by ``host_loop.run_slices``, and the slice's
stats are emitted. Its model, compiled generator and writer threads are the process's
``Worker``, built once per process (and per program) and shared by every DoFn instance.

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

On Dataflow the worker's local devices must number ``settings.devices_per_host``, since
the slice size depends on it; the worker checks this. Counters (namespace ``generate``):
slices_generated, slices_skipped, slices_redone, images.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils import shared
from apache_beam.utils.timestamp import MIN_TIMESTAMP
from apache_beam.utils.windowed_value import WindowedValue

from pipeline.core import buckets, logs, naming, slicing
from pipeline.core.settings import Run
from pipeline.generate import compile_cache as cache_lib
from pipeline.generate import bucket_programs, environment, host_loop, jax_events, runtime, scoring
from pipeline.io import beamio, runs, storage


class BeamEngineError(RuntimeError):
    pass


def check_devices(found: int, wanted: int, platform: str = "") -> None:
    """Raise BeamEngineError unless the worker has the ``devices_per_host`` the run was planned for."""
    if found != wanted:
        where = f" {platform}" if platform else ""
        raise BeamEngineError(
            f"this worker has {found} local{where} device(s), but the run was planned with --devices-per-host "
            f"{wanted} (the slice size depends on it): plan with --devices-per-host {found}, or run on workers "
            f"with {wanted} devices (locally the engine sets XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{wanted} itself, unless JAX already started in this process)")


def worker_id(machine: str, pid: int) -> int:
    """The ``host`` column of the slices a worker process generates (pure): a 31-bit
    hash of its machine's name and its process id, the same for the process's life."""
    return zlib.crc32(f"{machine}:{pid}".encode()) & 0x7FFFFFFF


class Worker:
    """One worker process's model, compiled generator and writer threads.

    Built once per process (and per ``runtime.program_tag``) through ``_SHARED`` and
    shared by every DoFn instance and thread of the process, and by later pipelines in it.
    With ``compile_cache``, JAX's persistent compilation cache is on before anything compiles.
    """

    def __init__(self, run: Run, out: str, compile_cache: str | None = None, base: "Worker | None" = None):
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


_SHARED = shared.Shared()  # per process: the Worker every DoFn instance of the process uses


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
        # make_worker(run) -> the worker (default: the model loaded once per process, Worker);
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
                worker = _SHARED.acquire(lambda: Worker(run, self.out, self.compile_cache, base),
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
