"""``run --engine beam``: the whole job as one Beam pipeline, each worker on its own devices.

Dataflow runs only single-host TPU workers, so this engine needs no ``jax.distributed``:
every worker process loads the model once and generates whole slices on its local
devices, with the same generator, host loop, writers and collect code as the pod engine.
Given the same settings and per-device batch, both engines write byte-identical images.

  Plan            ``pipeline.plan.transforms.Plan``: prompt files -> slices -> the manifest
                  (one element)
  Slices          the manifest's slice count -> its slice indices, spread over the workers
                  (``SliceIndices``: the count in chunks, each chunk enumerated by a worker)
  Generate        ``beam_worker.GenerateSlicesFn``: the model, loaded once per worker process; per
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

The Generate step, its workers and the ``host`` column they write are
``pipeline.engines.beam_worker``'s. Locally the engine runs on a local runner
(DirectRunner by default) with ``settings.devices_per_host`` CPU devices, like one host of
the local pod engine.
"""
from __future__ import annotations

import os
import sys

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from pipeline.collect import transforms as collect
from pipeline.core import buckets, logs, naming
from pipeline.core.settings import Run, Settings
from pipeline.engines.beam_worker import BeamEngineError, GenerateSlicesFn
from pipeline.generate import compile_cache as cache_lib
from pipeline.generate import fit
from pipeline.io import ledgers, runs, storage
from pipeline.model.layers.attention import check_platform
from pipeline.plan import transforms as plan
from pipeline.plan.prepare import prepare

# Runners that run the DoFns on this machine (Beam's LOCAL_RUNNERS, and Prism, which the
# DirectRunner may hand the pipeline to): their workers get local CPU devices.
LOCAL_RUNNERS = ("DirectRunner", "BundleBasedDirectRunner", "SwitchingDirectRunner", "FnApiRunner",
                 "PrismRunner", "TestDirectRunner")


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


def release_collect(span: plan.Span, manifest: dict) -> dict:
    """The barrier between generate and collect (pure): every planned slice came out of
    Generate (committed, or found committed) exactly once (``span``: what ``plan.IndexSpan``
    counted of them); returns the manifest, for collect."""
    if not span.exactly(manifest["slices"]):
        raise BeamEngineError(f"generate emitted {span.describe(manifest['slices'])}")
    return manifest


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
