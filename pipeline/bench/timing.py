"""Timing the generators of a bench: batch calls, and several programs timed in turns.

On a shared machine the speed drifts by 10-20% over minutes. Programs that are compared
are therefore timed batch by batch in turns (``in_turns``), never one after the other,
so that the drift falls evenly on all of them.
"""
from __future__ import annotations

from pipeline.core import logs


def bench_prompts(count: int, offset: int) -> list[str]:
    return [f"bench prompt {offset + i}: a photograph of a lighthouse on a cliff at dusk" for i in range(count)]


def ours_call(generator, guidance: float):
    """``call(i)``: the Generator on batch ``i``, built with ``Generator.batch`` (tokenising
    included); it returns numpy images, so it waits for the devices."""
    n = generator.batch_size

    def call(i):
        batch = generator.batch(bench_prompts(n, i * n), [""] * n, [guidance] * n, range(i * n, (i + 1) * n),
                                [0] * n)
        return generator(batch)

    return call


def scored_call(generator, scorer, guidance: float):
    """``ours_call`` with every image scored by ``scorer`` (``pipeline.generate.scoring``) on the
    devices, as a host runs them: the prompts tokenised for CLIP too, the scoring program
    dispatched on the sampler's output, and both fetched, so it waits for both."""
    n = generator.batch_size

    def call(i):
        prompts = bench_prompts(n, i * n)
        batch = generator.batch(prompts, [""] * n, [guidance] * n, range(i * n, (i + 1) * n), [0] * n)
        ids = scorer.tokenize(prompts)
        generated = generator.dispatch(batch)
        scored = scorer.dispatch(generated, generator, ids)
        return generator.fetch(generated), scorer.fetch(scored)

    return call


def seed_call(recipe, batch_size: int, steps: int, width: int, height: int):
    """``call(i)``: the seed recipe on batch ``i``, down to PIL images."""
    def call(i):
        return recipe(bench_prompts(batch_size, i * batch_size), steps, height, width, seed=i)

    return call


def timed(call, i: int) -> float:
    watch = logs.Stopwatch()
    call(i)
    return watch.seconds()


def throughput(first: float, seconds: list[float], batch_size: int) -> dict:
    return {"first_batch_s": round(first, 3), "images": batch_size * len(seconds),
            "batch_seconds": [round(t, 3) for t in seconds], "seconds": round(sum(seconds), 3),
            "images_per_s": batch_size * len(seconds) / sum(seconds)}


def in_turns(calls: dict, batch_sizes: dict, batches: int) -> dict:
    """{name: ``throughput``} of each call: a warm-up batch each, then ``batches`` rounds in
    which every call runs one batch, in the order given."""
    first = {name: timed(call, 0) for name, call in calls.items()}
    seconds = {name: [] for name in calls}
    for i in range(1, batches + 1):
        for name, call in calls.items():
            seconds[name].append(timed(call, i))
    return {name: throughput(first[name], seconds[name], batch_sizes[name]) for name in calls}
