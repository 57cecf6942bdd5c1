"""The scoring program: every image scored on the devices that made it, from its pixels.

``--score clip,aesthetic,safety`` computes, per image, the CLIP similarity of the image
and its prompt, LAION's aesthetic score and the safety checker's margin and decision
(``pipeline.model.scorers``), from the uint8 images the sampler left on the devices: no
image goes to the host and back to be scored. It is a program of its own, over the
generator's mesh (each device scores its own rows, ``shard_map``), and dispatched right after each sampler step on that step's
output, so:

* an image's bytes are the sampler's, with scores on or off (the sampler program is
  the same program either way);
* it is compiled once, ahead of time, from shapes (``compile_scorer``), in the
  executable cache and its index like the sampler, and warmed up with the sampler's
  padding batch (``warm_up``): nothing compiles after warm-up;
* each device scores its own images with the same per-device batch, so scores, like
  images, do not depend on the number of hosts or devices, or on the engine.

The host only tokenises the prompts with CLIP's tokenizer (beside the sampler's own) and
fetches a few floats per image.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipeline.core import logs
from pipeline.core.choices import SCORE_COLUMNS
from pipeline.generate import compile_cache, jax_events
from pipeline.generate.generator import load_indexed_program, replicate, replicated_shapes, same_shapes
from pipeline.model import sharding
from pipeline.model.scorers import aesthetic, clip as clip_lib, models, preprocess, safety

COLUMNS = tuple(column for columns in SCORE_COLUMNS.values() for column in columns)


class ScoringError(RuntimeError):
    pass


def make_score_fn(scorers: models.Scorers):
    """``score(params, images, ids) -> {column: [B]}`` for one device's batch: uint8 images
    [B, H, W, 3], CLIP token ids int32 [B, L] (read only for ``clip``); the columns of the
    run's scores (``SCORE_COLUMNS``): float32, and ``nsfw`` bool."""
    clip, head, checker = scorers.clip, scorers.head, scorers.checker

    def score(params, images, ids):
        out, pixels = {}, {}

        def pixels_for(pre):  # a checker preprocessed like CLIP reuses CLIP's pixels
            if pre not in pixels:
                pixels[pre] = preprocess.apply(pre, images)
            return pixels[pre]

        if clip is not None:
            embeds = clip_lib.image_embeds(clip, params["clip"], pixels_for(clip.preprocessing))
            if "clip" in scorers.scores:
                out["clip_similarity"] = clip_lib.similarity(embeds, clip_lib.text_embeds(clip, params["clip"], ids))
            if head is not None:
                out["aesthetic"] = aesthetic.apply(params["aesthetic"], embeds)
        if checker is not None:
            out["nsfw_score"], out["nsfw"] = safety.check(checker, params["safety"], pixels_for(checker.preprocessing))
        return out

    return score


def token_length(scorers: models.Scorers) -> int:
    """The ids' length the program takes: CLIP's with ``clip``, else 1 (not read)."""
    return scorers.clip.max_length if "clip" in scorers.scores else 1


@dataclasses.dataclass(frozen=True)
class ScorerProgram:
    """The scoring program compiled (or loaded) for one set of devices, and how it was made."""
    compiled: object
    params: object  # the replicated params' ShapeDtypeStructs it takes
    devices: tuple
    from_cache: bool
    compiles: int
    seconds: float
    lowered: bool = True  # False: found through the executable cache's index, nothing traced


def lower_scorer(scorers: models.Scorers, width: int, height: int, per_device_batch: int, devices):
    """The scoring program for ``devices``, lowered from shapes alone: one program over the
    host's mesh at ``--fsdp 1`` (``sharding.mesh``), the scorers' params whole on every
    device, the batch's rows split over the devices, each device scoring its own
    per-device batch (``shard_map``), as the sampler left them there."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    devices = list(devices)
    the_mesh = sharding.mesh(devices, 1)
    rows = sharding.batch_sharding(the_mesh, 1).spec
    fn = jax.jit(jax.shard_map(make_score_fn(scorers), mesh=the_mesh, in_specs=(PartitionSpec(), rows, rows),
                               out_specs=rows, check_vma=False))
    n = len(devices) * per_device_batch
    return fn.lower(replicated_shapes(scorers.params, devices),
                    jax.ShapeDtypeStruct((n, height, width, 3), jnp.uint8,
                                         sharding=sharding.batch_sharding(the_mesh, 4)),
                    jax.ShapeDtypeStruct((n, token_length(scorers)), jnp.int32,
                                         sharding=sharding.batch_sharding(the_mesh, 2)))


def compile_scorer(scorers: models.Scorers, width: int, height: int, per_device_batch: int, devices,
                   index_key: str | None = None) -> ScorerProgram:
    """The scoring program, lowered from ``scorers``' shapes (arrays or ShapeDtypeStructs)
    and compiled, or loaded from the executable cache (``compile_cache.load_or_compile``)."""
    jax_events.COMPILES.install()
    started = time.perf_counter()
    devices = list(devices)
    compiles = jax_events.COMPILES.count_here()
    lowered = lower_scorer(scorers, width, height, per_device_batch, devices)
    params = replicated_shapes(scorers.params, devices)
    compiled, from_cache = compile_cache.load_or_compile(lowered, devices,
                                                         index=(index_key, params) if index_key else None)
    return ScorerProgram(compiled, params, tuple(devices), from_cache, jax_events.COMPILES.count_here() - compiles,
                         time.perf_counter() - started)


def indexed_scorer(index_key: str, devices) -> ScorerProgram | None:
    """The program an earlier run of this host compiled under ``index_key``, loaded without
    lowering anything; None if there is none."""
    found = load_indexed_program(index_key, devices)
    if found is None:
        return None
    compiled, params, compiles, seconds = found
    return ScorerProgram(compiled, params, tuple(devices), True, compiles, seconds, lowered=False)


class Scorer:
    """The scoring program on the generator's devices, with the scorer models' params
    replicated there. ``dispatch`` takes what the generator's ``dispatch`` returned."""

    def __init__(self, scorers: models.Scorers, width: int, height: int, per_device_batch: int, devices, *,
                 program: ScorerProgram | None = None, params=None):
        """``params``: ``scorers``' params already replicated on ``devices`` (another size's
        scorer's), shared instead of copied again."""
        import jax

        self.scorers = scorers
        self.devices = list(devices)
        self.per_device_batch = per_device_batch
        self.batch_size = len(self.devices) * per_device_batch
        self.params = params if params is not None else jax.block_until_ready(replicate(scorers.params, self.devices))
        same = program is not None and program.devices == tuple(self.devices) and \
            same_shapes(program.params, self.params)
        if not same:
            program = compile_scorer(scorers, width, height, per_device_batch, self.devices)
        self.program = program

    def tokenize(self, prompts) -> np.ndarray:
        """CLIP token ids of a batch's prompts, [N, L] (zeros without ``clip``: not read)."""
        if "clip" not in self.scorers.scores:
            return np.zeros((len(prompts), 1), np.int32)
        return clip_lib.tokenize(self.scorers.clip, prompts)

    def dispatch(self, generated, generator, ids: np.ndarray):
        """Start scoring the images of a dispatched sampler step (``generated``: what
        ``generator.dispatch`` returned; its images stay on the devices); asynchronous."""
        import jax

        images = generated[0] if generator.latents else generated  # [N, H, W, 3], split over the mesh
        ids = np.asarray(ids)
        return self.program.compiled(self.params, images,
                                     jax.device_put(ids, sharding.batch_sharding(sharding.mesh(self.devices, 1),
                                                                                 ids.ndim)))

    def fetch(self, handle) -> dict[str, np.ndarray]:
        """{column: values [N]} of a dispatched scoring, in batch order (blocks until done)."""
        return {name: np.asarray(values).reshape(self.batch_size) for name, values in handle.items()}


def description(settings) -> dict:
    """What the run's scoring program is made of, for the executable cache's index."""
    return {"scorers": models.program_description(settings), "width": settings.width, "height": settings.height,
            "per_device_batch": settings.per_device_batch}


def check_models(run, scorers_found: dict) -> None:
    """ScoringError naming each scorer model whose fingerprint is not the one the run was planned with."""
    planned = dict(run.scorers)
    changed = sorted(name for name in planned if scorers_found.get(name) != planned[name])
    if changed:
        flags = {"clip": "--clip-model", "aesthetic": "--aesthetic-head", "safety": "--safety-checker"}
        raise ScoringError(f"the scorer model(s) {', '.join(f'{flags[n]} ({n})' for n in changed)} differ from the "
                           f"ones the run was planned with: scoring needs the same files")


def scorer_program(settings, devices) -> ScorerProgram:
    """The scoring program of ``settings`` on ``devices``: found through the executable
    cache's index, or compiled from the scorer models' shapes."""
    key = compile_cache.index_key(description(settings), devices)
    found = indexed_scorer(key, devices)
    if found is not None:
        return found
    return compile_scorer(models.load(settings, abstract=True), settings.width, settings.height,
                          settings.per_device_batch, devices, index_key=key)


def ready_scorer(run, devices, like: Scorer | None = None) -> tuple[Scorer | None, dict]:
    """(the run's scorer on ``devices``, or None without --score; seconds of each part). The
    program is found through the executable cache's index, or compiled from the models'
    shapes, on a thread while this one loads the weights and checks their fingerprints.

    ``like``: the scorer of another size of the same run on the same devices, whose models
    and params on the devices this one shares (loaded and checked once per host); only the
    program, which takes images of this run's size, is this one's own."""
    settings = run.settings
    if not settings.scores:
        return None, {}
    devices = list(devices)
    started = time.perf_counter()
    if like is not None:
        if like.devices != devices:
            raise ValueError("a scorer shares another's params only on the same devices")
        models.check_images(like.scorers, settings.width, settings.height)
        compiled = scorer_program(settings, devices)
        scorer = Scorer(like.scorers, settings.width, settings.height, settings.per_device_batch, devices,
                        program=compiled, params=like.params)
        return scorer, {"scorer_compile": compiled.seconds, "scorer_ready": time.perf_counter() - started}


    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-scorer") as pool:
        compiling = pool.submit(scorer_program, settings, devices)
        check_models(run, models.fingerprints(settings, run.model_fingerprint))
        loaded = models.load(settings)
        models.check_images(loaded, settings.width, settings.height)
        load_s = time.perf_counter() - started
        compiled = compiling.result()
    scorer = Scorer(loaded, settings.width, settings.height, settings.per_device_batch, devices, program=compiled)
    if scorer.program is not compiled:
        logs.event("scorer_recompiled", reason="the weights' shapes differ from the configs'")
    return scorer, {"scorer_load": load_s, "scorer_compile": compiled.seconds,
                    "scorer_ready": time.perf_counter() - started}


def cache_stats(scorer: Scorer | None) -> dict:
    """For a host's ready event: whether the scoring program came from the executable cache
    (``scorer_from_cache``) and was traced (``scorer_lowered``: False when found through the
    index); {} without a scorer."""
    if scorer is None:
        return {}
    return {"scorer_from_cache": scorer.program.from_cache, "scorer_lowered": scorer.program.lowered}


def warm_up(generator, scorer: Scorer | None) -> int:
    """Run one padding batch through the sampler and, with ``scorer``, the scoring program
    on its images (each program's first execution); returns the process's compile count
    after it, from which later compilations are counted (``Generator.warm_up``)."""
    if scorer is None:
        return generator.warm_up()
    generated = generator.dispatch(generator.padding_batch())
    scorer.fetch(scorer.dispatch(generated, generator, scorer.tokenize([""] * generator.batch_size)))
    generator.fetch(generated)
    return jax_events.COMPILES.count()
