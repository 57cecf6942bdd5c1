"""``generate``: the work of one host process.

The host joins the cluster, loads the model once, compiles the sampler once, and runs
its slice slots (``slicing.host_slots``). Every host runs the same number of device
steps: a padding slot, and the padding rows that fill the last slice, run on the
devices but are never written.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from pipeline.core import buckets, crashpoints, interrupts, logs, naming, slicing
from pipeline.core.settings import Run
from pipeline.generate import (bucket_programs, cluster, environment, jax_events, progress, runtime, scoring,
                               stopping)
from pipeline.generate.generator import Generator
from pipeline.io import lease, ledgers
from pipeline.output import writer

WRITER_THREADS = 8  # encoders and uploaders; JAX releases the GIL while devices work


def _done_at(generator, handle, dispatched_at: float) -> tuple[float, float]:
    """(when the step was dispatched, when the device finished it), on a watcher thread."""
    generator.wait(handle)
    return dispatched_at, time.perf_counter()


class _DeviceClock:
    """Device-busy time from when each step was dispatched and finished. The devices run
    steps in dispatch order, so a step runs from its dispatch or the previous step's end,
    whichever is later, to its own end; the rest of the time the devices sat idle."""

    def __init__(self):
        self.last_end = 0.0
        self.idle = 0.0  # how long the devices sat idle before the last step (0 before the first)

    def busy(self, span: tuple[float, float]) -> float:
        dispatched, end = span
        self.idle = max(0.0, dispatched - self.last_end) if self.last_end else 0.0
        seconds = max(0.0, end - max(dispatched, self.last_end))
        self.last_end = max(self.last_end, end)
        return seconds


class _Slice:
    """One slice on its way through the host loop: its items, writer and timing."""

    def __init__(self, out: str, made: _Made, index: int, host: int, pool, queued):
        """Slice ``index`` of ``made``'s size, written by ``pool``'s threads (``queued``: the
        images handed to the writers, all slices)."""
        self.watch = logs.Stopwatch()
        self.started_ts = time.time()
        self.index, self.size, self.host = index, made.size, host
        self.items = writer.read_slice_items(out, index)
        self.padded = [*self.items, *[None] * (made.size - len(self.items))]
        self.writer = writer.SliceWriter(out, made.run, index, host, pool, zarr_images=made.zarr_images,
                                         zarr_latents=made.zarr_latents, slots=queued, zarr_group=made.zarr_group,
                                         zarr_offset=made.zarr_offset)
        self.timing = {"input_s": 0.0, "device_wait_s": 0.0, "output_s": 0.0, "device_busy_s": 0.0}
        self.truncated_prompts = 0  # images whose prompt was cut to the text encoder's length
        self.batches_handed = 0
        self.compiles = 0

    def commit(self) -> dict:
        """Wait for the slice's images, write its whole objects, then its commit marker."""
        clock = logs.Stopwatch()
        self.writer.finish()
        seconds = self.watch.seconds()
        stats = {"slice": self.index, "host": self.host, "images": len(self.items),
                 "padding": self.size - len(self.items), "seconds": round(seconds, 4), "batches": self.batches_handed,
                 "images_per_s": round(len(self.items) / seconds, 3) if seconds else None,
                 **{name: round(value, 4) for name, value in self.timing.items()},
                 "commit_s": round(clock.seconds(), 4), "compiles_after_warmup": self.compiles,
                 "truncated_prompts": self.truncated_prompts,
                 "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 # unix times of the slice's start and of its commit, for timelines across slices
                 "started_ts": round(self.started_ts, 3), "committed_ts": round(time.time(), 3)}
        self.writer.mark(stats)
        return stats


def run_slices(sizes: _Sizes, out: str, slots, host: int, pool, *, compiles_at_warm: int = 0,
               on_commit: Callable[[dict], None] | None = None,
               stop: Callable[[], bool] | None = None) -> list[dict]:
    """Generate, write and commit the slices ``slots`` names, in order; returns their stats.
    ``sizes``: the programs, slice size and zarr arrays of each size of the loop
    (``one_size``, or ``host_sizes`` for a run of several); ``pool``: the writers' threads.

    A slot is a slice index, or ``None`` for a padding slot (its device steps run, nothing
    is written). The devices never wait for the host: the next batch is tokenised and
    dispatched before the current one is fetched, across slice boundaries too; images go
    to ``pool`` (bounded by the writer's backpressure); and a finished slice's shards and
    commit marker are written by one committer thread, in slot order, while the next
    slice runs. A failure in any worker fails the loop and that slice is never committed.
    ``on_commit`` runs on the committer thread after each commit marker.

    ``stop`` (``stopping.SyncStop``) is asked before each batch is dispatched; once it says
    so, nothing new is dispatched: the batch in flight is handed over only if it is its
    slice's last (that slice is whole, and commits), the slice under way is left
    uncommitted, and the loop returns once the commit in progress is written.

    A size's scorer (``scoring.Scorer``, with --score): each batch's images are scored on the
    devices right after they are made, and their scores go to the writers with them.

    In a run of several sizes the slots are (size index, slice or None), every size has its
    own generator, scorer, slice size and zarr arrays, and the batches of one size follow
    the last of the size before without a pause.
    """
    done: list[dict] = []
    committing: Future | None = None  # the previous slice's commit
    queued = threading.BoundedSemaphore(writer.MAX_PENDING)  # images handed to the writers, all slices

    def steps():  # (size's programs, slice or None for padding, chunk, is the slice's last batch)
        for slot in slots:
            bucket, slot = slot if isinstance(slot, tuple) else (0, slot)
            made = sizes.of(bucket)
            n, size = made.generator.batch_size, made.size
            state = None if slot is None else _Slice(out, made, slot, host, pool, queued)
            padded = [None] * size if state is None else state.padded
            for start in range(0, size, n):
                yield made, state, padded[start:start + n], start + n >= size

    def committed_previous() -> None:
        if committing is not None:
            committing.result()  # re-raises the committer's failure

    def commit(state: _Slice) -> dict:
        stats = state.commit()
        done.append(stats)
        if on_commit is not None:
            on_commit(stats)
        return stats

    def hand_over(flight: _InFlight) -> None:  # a dispatched batch, to the writers
        nonlocal committing
        made, state, chunk, cut = flight.made, flight.state, flight.chunk, flight.cut
        clock = logs.Stopwatch()
        images, latents = made.generator.fetch(flight.handle)
        scores = None if flight.scored is None else made.scorer.fetch(flight.scored)
        busy = device.busy(flight.done_at.result())
        if made is not seen[0]:  # the first step of another size: how long the devices waited for it
            if seen[0] is not None:
                logs.event("size_switch", host=host, size=f"{made.run.settings.width}x{made.run.settings.height}",
                           idle_s=round(device.idle, 4), batch_s=round(busy, 4))
            seen[0] = made
        if state is None:  # padding slot
            return
        state.timing["device_wait_s"] += clock.seconds()
        state.timing["device_busy_s"] += busy
        clock = logs.Stopwatch()
        if committing is not None and committing.done():
            committed_previous()  # fail as soon as a commit has failed
        for k, (item, image) in enumerate(zip(chunk, images)):
            if item is not None:
                state.truncated_prompts += cut[k]
                state.writer.add(item, image, None if latents is None else latents[k], cut[k],
                                 None if scores is None else {name: values[k] for name, values in scores.items()})
        state.batches_handed += 1
        if state.batches_handed == 1:
            crashpoints.reached("mid_slice", host, before=lambda: (committed_previous(), state.writer.wait_images()))
        if flight.last:
            state.compiles = sizes.compiles_since(compiles_at_warm)
            committed_previous()  # at most one slice commits while the next one runs
            committing = committer.submit(commit, state)
        state.timing["output_s"] += clock.seconds()

    device = _DeviceClock()
    seen = [None]  # the size of the last step handed over
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="committer") as committer, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-clock") as watcher:
        previous, stopped = None, False
        for made, state, chunk, last in steps():
            if stop is not None and stop():
                stopped = True
                break
            clock = logs.Stopwatch()
            generator, scorer, n = made.generator, made.scorer, made.generator.batch_size
            default_guidance = made.run.settings.guidance_scale
            batch = generator.batch_of([None if item is None else item.inputs(default_guidance) for item in chunk])
            prompts = [item.prompt if item is not None else "" for item in chunk]
            cut = generator.truncated(prompts)
            ids = None if scorer is None else scorer.tokenize(prompts + [""] * (n - len(prompts)))
            if state is not None:
                state.timing["input_s"] += clock.seconds()
            dispatched_at = time.perf_counter()
            handle = generator.dispatch(batch)
            scored = None if scorer is None else scorer.dispatch(handle, generator, ids)
            crashpoints.batch_dispatched()
            # the devices are busy until the step's last program (the scorer's, if any) is done
            done_at = watcher.submit(_done_at, generator, handle if scored is None else scored, dispatched_at)
            dispatched = _InFlight(made, state, chunk, cut, handle, last, done_at, scored)
            if previous is not None:
                hand_over(previous)
            previous = dispatched
        if previous is not None and (not stopped or previous.last):
            hand_over(previous)
        committed_previous()
    return done


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A batch dispatched to the devices and not yet handed to the writers."""
    made: _Made  # its size's programs
    state: _Slice | None  # its slice (None: a padding slot)
    chunk: list  # its slice's items it holds (None for padding rows)
    cut: list  # whether each one's prompt was cut to the text encoder's length
    handle: object  # the generator's output on the devices
    last: bool  # the slice's last batch
    done_at: Future  # (dispatched, done) times of its device step
    scored: object  # the scorer's output on the devices, None without --score


@dataclasses.dataclass
class _Made:
    """One size's part of a host loop: its run (a single-size run of the size), programs,
    slice size and zarr arrays (``zarr_offset``: the position of the size's first image)."""
    run: Run
    generator: object
    scorer: object
    size: int
    zarr_images: object = None
    zarr_latents: object = None
    zarr_group: str = ""
    zarr_offset: int = 0


class _Sizes:
    """The sizes of a host loop: ``of(b)`` is size ``b``'s ``_Made``, its programs from
    ``bucket_programs.BucketPrograms`` (waiting for a compile still under way, and starting
    the next size's)."""

    def __init__(self, run: Run, geometry, programs, zarr: dict):
        self.run, self.geometry, self.programs, self.zarr = run, geometry, programs, zarr
        self._made: dict[int, _Made] = {}
        self.loop_compiles = jax_events.COMPILES.count_here()  # made on the loop's thread, before it starts

    def of(self, bucket: int) -> _Made:
        if bucket not in self._made:
            from pipeline.generate.bucket_programs import bucket_run

            program = self.programs.get(bucket)
            geometry = self.geometry.buckets[bucket]
            images, latents = self.zarr.get(bucket, (None, None))
            self._made[bucket] = _Made(bucket_run(self.run, bucket), program.generator, program.scorer,
                                       geometry.slice_size, images, latents, geometry.name, geometry.offset)
        return self._made[bucket]

    def compiles_since(self, compiles_at_warm: int) -> int:
        """Backend compilations since warm-up that were not a size's programs: in a
        single-size run, every compilation of the process since ``compiles_at_warm``; with
        several sizes, whose later programs compile on a thread of their own while the
        loop runs, those of the loop's own thread since it started."""
        if self.programs is None:
            return jax_events.COMPILES.count() - compiles_at_warm
        return jax_events.COMPILES.count_here() - self.loop_compiles


def host_sizes(run: Run, geometry, programs, zarr: dict) -> "_Sizes":
    """The ``sizes`` argument of ``run_slices`` for a run of several sizes: ``geometry``
    (``buckets.Geometry``), ``programs`` (``bucket_programs.BucketPrograms``), ``zarr``:
    {size index: (images, latents) zarr arrays}."""
    return _Sizes(run, geometry, programs, zarr)


def one_size(generator: Generator, run: Run, size: int, *, scorer=None, zarr_arrays=(None, None),
             zarr_group: str = "", zarr_offset: int = 0) -> _Sizes:
    """The ``sizes`` argument of ``run_slices`` for slices of one size, ``size`` images each:
    a single-size run's, or one size of a run of several (a Beam worker's bundle: ``run`` is
    that size's, ``bucket_programs.bucket_run``, its zarr arrays (images, latents) its
    group's, ``zarr_group``, starting at position ``zarr_offset``)."""
    sizes = _Sizes(run, None, None, {})
    sizes._made[0] = _Made(run, generator, scorer, size, *zarr_arrays, zarr_group, zarr_offset)
    return sizes


def generate(out: str, cluster_args: cluster.ClusterArgs, compile_cache: str | None = None) -> dict:
    """Run this host's share of the plan in ``out``; returns a summary.

    With ``compile_cache`` (a folder), compiled programs are loaded from JAX's persistent
    compilation cache there, or compiled and written to it (``pipeline.generate.compile_cache``).

    A SIGTERM to any host of the run stops every host at the same batch
    (``pipeline.generate.stopping``): each logs ``host_stopped`` and the process exits
    143, its committed slices kept for a re-run to skip. While it runs, the host keeps
    its progress object under ``out`` (``pipeline.generate.progress``).
    """
    from pipeline.generate import compile_cache as cache_lib

    stopping.watch_launcher_from_env()  # first: a host never outlives the `promptmill run` that started it
    jax_events.COMPILES.install()  # first: count every compilation of this host (host_ready)
    if compile_cache:  # first: every program this host compiles should go through the cache
        cache_dir = cache_lib.enable(compile_cache)
    host, num_hosts = cluster.initialize(cluster_args)  # from here, JAX's preemption service holds SIGTERM
    try:
        stopping.forward_sigint()
        if compile_cache:
            logs.event("compile_cache", host=host, path=cache_dir)
        run, manifest = runtime.load_planned(out)
        holder = lease.host_renewer(out)  # a host writes only while its run holds OUT
        # every attempt makes the run's images in the same environment, which each row names
        run = dataclasses.replace(run, environment=environment.establish(out, environment.current(), f"host {host}"))
    except KeyboardInterrupt as e:  # a signal Python took while the host joined, before JAX's service did
        _stopped_early(host, e)
    tracker = progress.Progress(out, naming.progress_name(host), host, num_hosts).start()
    try:
        summary = _run_host(out, run, manifest, (host, num_hosts), compile_cache, holder)
    except KeyboardInterrupt as e:
        _stopped_early(host, e, tracker)
    except BaseException as e:
        logs.event("host_failed", level=logging.ERROR, host=host, error=f"{type(e).__name__}: {e}")
        raise
    finally:
        tracker.close()
        if holder is not None:
            holder.stop()
    if summary["stopped"]:
        stopping.exit_now(stopping.EXIT_STOPPED, last=lambda: cluster.leave(host, num_hosts))
    return summary


def _stopped_early(host: int, error: KeyboardInterrupt, tracker: progress.Progress | None = None) -> None:
    """Leave at once, before the first batch (nothing to commit), without JAX's shutdown,
    whose barrier would wait for the other hosts."""
    logs.event("host_stopped", host=host, signal=interrupts.signal_name(error), step=None, slices=[])
    if tracker is not None:
        tracker.close()
    stopping.exit_now(interrupts.exit_code(error))


def _run_host(out: str, run: Run, manifest: dict, cluster_place: tuple[int, int], compile_cache: str | None,
              holder: lease.Renewer | None) -> dict:
    """``generate`` once the host (``cluster_place``: host, number of hosts) has joined the
    cluster: returns its summary, whose ``stopped`` says whether the run stopped before
    this host's slices were all done. ``holder``: the run's lease renewer; once another
    run has taken OUT, no further slice is started."""
    from pipeline.generate import compile_cache as cache_lib

    host, num_hosts = cluster_place
    settings = run.settings
    logs.event("host_started", host=host, hosts=num_hosts, slices=manifest["slices"])
    started = logs.Stopwatch()
    geometry = buckets.Geometry.of_manifest(manifest, settings.width, settings.height, settings.per_device_batch)
    # a resumed run's committed slices of this host, from its ledger (a listing of the markers when
    # the ledger cannot be trusted), which it adds each commit to
    ledger = ledgers.HostLedger(out, run, geometry, host, num_hosts)
    committed_before = ledger.start()
    # a run of several sizes starts with the programs of the first size this host has work of: the
    # sizes no record asked for, or whose every slice this host would run is committed and that hold
    # no padding slot of it, are never made
    to_make = buckets.sizes_to_make(host, num_hosts, geometry, committed_before) if settings.sizes else (0,)
    first_size = to_make[0] if to_make else 0
    # the sampler compiles (or loads) on a thread while the weights load
    first = bucket_programs.bucket_run(run, first_size)
    model, generator, parts = runtime.ready_generator(first, out)
    scorer, scorer_parts = scoring.ready_scorer(first, generator.devices)  # None without --score
    parts.update(scorer_parts)
    size = geometry.buckets[first_size].slice_size if settings.sizes else manifest["slice_size"]
    batches = slicing.batches_per_slice(size, len(generator.devices), first.settings.per_device_batch)
    compiles_at_warm = scoring.warm_up(generator, scorer)
    cache_stats = {}
    if compile_cache:  # jax's cache (host 0 writes it) and this host's executables
        executables = cache_lib.EXECUTABLE_COUNTS
        cache_stats = {"cache_hits": jax_events.CACHE.count(jax_events.CACHE_HIT) + executables["hits"],
                       "cache_writes": jax_events.CACHE.count(jax_events.CACHE_WRITE) + executables["writes"],
                       "sampler_from_cache": generator.from_cache, "sampler_lowered": generator.sampler_lowered,
                       **scoring.cache_stats(scorer)}
    # compiles: the host's backend compilations so far, sampler_compiles those of the
    # sampler (0 when it came from the cache); ready_s: seconds since host_started;
    # load_s, compile_s (overlapping the load), wait_s, transfer_s: ``runtime.ready_generator``
    logs.event("host_ready", host=host, devices=len(generator.devices), batches_per_slice=batches,
               **({"size": f"{first.settings.width}x{first.settings.height}", "bucket": first_size}
                  if settings.sizes else {}),
               compiles=compiles_at_warm, sampler_compiles=generator.sampler_compiles,
               ready_s=round(started.seconds(), 3), **{f"{k}_s": round(v, 3) for k, v in parts.items()},
               **cache_stats)
    if compile_cache:
        uploaded = cache_lib.push()
        if uploaded:
            logs.event("compile_cache_pushed", host=host, entries=uploaded)
    crashpoints.reached("ready", host)

    if settings.sizes:  # each size's zarr arrays, in its own group, and its programs, compiled once each
        zarr_by_size = {b: runtime.open_zarr(out, bucket_programs.bucket_run(run, b), model, bucket.images,
                                             group=bucket.name) for b, bucket in enumerate(geometry.buckets)}
        empty = tuple(b for b in range(len(geometry.buckets)) if b not in to_make)
        programs = bucket_programs.BucketPrograms(run, model, bucket_programs.Program(generator, scorer, 0, 0.0),
                                                  len(geometry.buckets), host=host, empty=empty, first_index=first_size)
        sizes = host_sizes(run, geometry, programs, zarr_by_size)
    else:
        programs = None
        sizes = one_size(generator, run, size, scorer=scorer,
                         zarr_arrays=runtime.open_zarr(out, run, model, manifest["images"]))
    counts = {"skipped": 0, "redone": 0}

    def slots():  # this host's slots still to do; a committed slice is never redone (resume)
        for bucket, slot in buckets.host_slots(host, num_hosts, geometry):
            if holder is not None and holder.lost.is_set():
                raise lease.LeaseLost(f"host {host} stops before slice {slot}: {holder.why}")
            if slot is None:  # padding slot: same device steps as a real slice, nothing written
                logs.event("padding_slot", host=host, **({"bucket": bucket} if settings.sizes else {}))
                yield (bucket, slot)
                continue
            decision = runtime.SliceDecision("skip") if slot in committed_before else runtime.decide(out, settings, slot)
            if decision.action == "skip":
                ledger.add(slot, geometry.slice_images(slot))  # a commit its ledger had missed, found by its marker
                counts["skipped"] += 1
                logs.event("slice_skipped", host=host, slice=slot)
                continue
            if decision.action == "redo":
                counts["redone"] += 1
                logs.event("slice_redone", host=host, slice=slot, leftover_objects=decision.leftover_objects)
            yield (bucket, slot)

    def committed(stats: dict) -> None:
        ledger.add(stats["slice"], stats["images"], stats["committed_ts"])
        logs.event("slice_committed", **stats)
        crashpoints.reached("committed", host)

    # every host starts its first batch together, so that their batch counts, which the
    # preemption sync point compares, keep in step (``stopping``)
    cluster.wait_for_all("promptmill-generate-start")
    stop = stopping.SyncStop()
    watch = logs.Stopwatch()
    with ThreadPoolExecutor(max_workers=WRITER_THREADS, thread_name_prefix="writer") as pool:
        try:
            done = run_slices(sizes, out, slots(), host, pool, compiles_at_warm=compiles_at_warm, on_commit=committed,
                              stop=stop)
        finally:
            if programs is not None:
                programs.close()
    size_compiles = 0 if programs is None else programs.compiles
    recompiles = jax_events.COMPILES.count() - compiles_at_warm - size_compiles
    # host 0 runs the coordination service: every host waits here until all are done (or one stopped)
    outcomes = cluster.finish(host, num_hosts, "stopped" if stop.stopped_at else "done")
    summary = {"host": host, "images": sum(s["images"] for s in done), "seconds": round(watch.seconds(), 3),
               "slices_generated": len(done), "slices_redone": counts["redone"], "slices_skipped": counts["skipped"],
               "compiles_after_warmup": recompiles,
               **({"sizes": len(geometry.buckets), "size_compiles": size_compiles} if settings.sizes else {})}
    stopped_hosts = sorted(h for h, outcome in outcomes.items() if outcome == "stopped")
    gone = sorted(h for h, outcome in outcomes.items() if outcome == "gone")
    if gone and not stop.stopped_at:
        raise RuntimeError(f"host(s) {gone} of {num_hosts} did not finish within {cluster.BARRIER_TIMEOUT_S} s")
    if stopped_hosts:
        # slices: those this host committed in this attempt; a re-run skips them
        logs.event("host_stopped", **summary, step=stop.stopped_at, batches=stop.step - bool(stop.stopped_at),
                   slices=sorted(s["slice"] for s in done), stopped_hosts=stopped_hosts, gone_hosts=gone)
    else:
        logs.event("host_done", **summary)
    return {**summary, "stopped": bool(stopped_hosts)}
