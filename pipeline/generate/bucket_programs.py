"""Each size's programs on one host: compiled once, the next while the current one runs.

A run of several sizes (``--sizes``, ``pipeline.core.buckets``) has one sampler program
per size, each that of a single-size run of the size (``Settings.for_bucket``), so an
image's bytes are those that run makes. The program of the first size the host has work
of is made before the first batch (``runtime.ready_generator``, while the weights load);
the later sizes' compile one after the other on a thread of their own from the start, so
no device waits for a compile between sizes. Every size's generator shares the weights on the devices.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

from pipeline.core import logs
from pipeline.core.settings import Run
from pipeline.generate import jax_events, runtime, scoring


def bucket_run(run: Run, index: int) -> Run:
    """The run as a single-size run of its size ``index`` (its program, images, metadata)."""
    if not run.settings.sizes:
        return run
    return dataclasses.replace(run, settings=run.settings.for_bucket(index))


@dataclasses.dataclass
class Program:
    """One size's generator and scorer (None without --score), with how they were made."""
    generator: object
    scorer: object
    compiles: int  # backend compilations that making them took (0: from the executable cache)
    seconds: float


class BucketPrograms:
    """The host's programs, by size index. ``first``: the programs of size ``first_index``, the
    first the host runs (made by the caller while the weights loaded). The later sizes'
    compile one after the other on a thread from the start, in the order the host runs them,
    so each is ready long before the host gets to it; ``get(b)`` returns size ``b``'s,
    waiting for its compile if it is still running."""

    def __init__(self, run: Run, model, first: Program, count: int, *, host: int = 0, empty: tuple[int, ...] = (),
                 first_index: int = 0):
        """``empty``: sizes this host runs nothing of (no record asked for them, or a resumed
        run committed them), whose programs are never needed."""
        self.run, self.model, self.count, self.host, self.empty = run, model, count, host, set(empty)
        self.first_index = first_index
        self._ready: dict[int, Program] = {first_index: first}
        self._compiling: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-next-size")
        self.compiles = 0  # backend compilations of the sizes after the first, on the compile thread
        for index in range(first_index + 1, count):
            self.prefetch(index)

    def _make(self, index: int) -> Program:
        watch = logs.Stopwatch()
        before = jax_events.COMPILES.count()  # the scorer compiles on a thread of its own: count them all
        first = self._ready[self.first_index].generator
        run = bucket_run(self.run, index)
        program = runtime.compile_run_sampler(run.settings, first.devices)
        generator = runtime.make_generator(self.model, run.settings, first.devices, program, first.params)
        scorer, _ = scoring.ready_scorer(run, first.devices, like=self._ready[self.first_index].scorer)
        compiles = jax_events.COMPILES.count() - before
        self.compiles += compiles
        made = Program(generator, scorer, compiles, watch.seconds())
        logs.event("size_ready", host=self.host, size=f"{run.settings.width}x{run.settings.height}", bucket=index,
                   per_device_batch=run.settings.per_device_batch, sampler_compiles=generator.sampler_compiles,
                   compiles=compiles, from_cache=generator.from_cache, seconds=round(made.seconds, 3))
        return made

    def prefetch(self, index: int) -> None:
        """Start compiling size ``index``'s programs (if there is one, and it is not made or under way)."""
        if index < self.count and index not in self._ready and index not in self._compiling \
                and index not in self.empty:
            self._compiling[index] = self._pool.submit(self._make, index)

    def get(self, index: int) -> Program:
        if index not in self._ready:
            self.prefetch(index)
            waited = logs.Stopwatch()
            self._ready[index] = self._compiling.pop(index).result()
            if waited.seconds() > 0.5:  # the devices waited for this size's compile
                logs.event("size_waited", host=self.host, bucket=index, seconds=round(waited.seconds(), 3))
        return self._ready[index]

    def close(self) -> None:
        for future in self._compiling.values():
            future.cancel()
        self._pool.shutdown(wait=True)
