"""The generator of one host: the model on the local devices, compiled once.

The sampling function is one program over a mesh of the host's local devices (axes
``data`` and ``fsdp``, ``pipeline.model.sharding``), jitted and compiled ahead of time for
the run's one set of shapes: at ``--fsdp 1`` every device holds a whole copy of the
parameters (the replicated run), at N > 1 the large weights are split over groups of N.
Either way the batch is split over every device, so each device computes its own images. Calling
the compiled executable can never recompile (a wrong shape is an error), and
``jax_events.COMPILES`` lets tests and logs prove that nothing else compiles either.

The sampler is lowered from shapes alone (``compile_sampler``): the params as
``jax.ShapeDtypeStruct``s with their shardings on the mesh, which gives the very program
that lowering from the placed arrays gives (same text, same executable cache key). So a
host can compile it, or load it from its executable cache, from an abstract model
(``load(abstract=True)``) on one thread while another reads the weights, and hand the
result to the Generator (``program``).

With ``latents=True`` the compiled program also returns each image's final latents
(``sampler.make_sample_fn``); without it, it is the images-only program, and no latents
ever leave the devices.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from pipeline.generate import compile_cache, jax_events, sampler
from pipeline.generate.spec import ProgramSpec
from pipeline.model import sharding
from pipeline.model.layers import attention as attention_lib


@dataclasses.dataclass(frozen=True)
class Batch:
    """One device step's inputs for N = local devices x per-device batch images."""
    prompt_ids: np.ndarray  # int32 [N, L] (SDXL: [N, 2, L])
    negative_ids: np.ndarray  # int32 like prompt_ids
    guidance: np.ndarray  # float32 [N]
    seed_hi: np.ndarray  # uint32 [N]
    seed_lo: np.ndarray  # uint32 [N]
    image_index: np.ndarray  # uint32 [N]


# (prompt, negative prompt, guidance, seed, image index) of a padding row: it fills a
# slice's or a batch's empty places, runs on the devices, and is never written
PADDING_ROW = ("", "", 0.0, 0, 0)


def replicate(tree, devices, dtype=None):
    """Put a whole copy of every leaf on each device: replicated over the host's mesh at
    ``--fsdp 1`` (``sharding.mesh``), as the host's programs take it. Each device is given
    its copy from the host array (``sharding.place``). ``dtype``: floating leaves are cast
    to it (``Model.param_dtype``: the host keeps its weights in their stored dtype)."""
    import jax

    the_mesh = sharding.mesh(devices, 1)
    whole = jax.sharding.NamedSharding(the_mesh, jax.sharding.PartitionSpec())
    return sharding.place(tree, jax.tree_util.tree_map(lambda _: whole, tree), dtype)


def replicated_shapes(tree, devices=None, dtype=None):
    """``jax.ShapeDtypeStruct``s of ``tree`` (arrays or structs) as ``replicate`` lays it
    out on ``devices`` (``dtype``: as ``replicate`` casts it); without ``devices``, of
    ``tree`` as it is, without shardings."""
    import jax

    from pipeline.model.shapes import struct

    if devices is None:
        return jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype),
                                      struct(tree, dtype))
    whole = jax.sharding.NamedSharding(sharding.mesh(devices, 1), jax.sharding.PartitionSpec())
    return sharding.shaped(tree, jax.tree_util.tree_map(lambda _: whole, tree), dtype)


def same_shapes(a, b) -> bool:
    """Whether two trees of arrays or structs have the same structure, shapes and dtypes
    (their shardings aside)."""
    import jax

    def plain(tree):
        return [(tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in jax.tree_util.tree_leaves(tree)]

    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and plain(a) == plain(b)


@dataclasses.dataclass(frozen=True)
class SamplerProgram:
    """A sampler compiled (or loaded) for one set of devices, and how it was made."""
    compiled: object
    params: object  # the replicated params' ShapeDtypeStructs it takes (``replicated_shapes``)
    devices: tuple
    from_cache: bool  # loaded from this host's executable cache (``compile_cache.load_or_compile``)
    compiles: int  # the backend compilations building it took, on its thread (0 when loaded)
    seconds: float  # lowering and compiling or loading it
    lowered: bool = True  # False: found through the executable cache's index, nothing traced
    fsdp: int = 1  # the weights' FSDP degree it was made for

    def takes(self, params, devices, fsdp: int = 1) -> bool:
        """Whether it runs on ``devices`` with ``params`` (as ``place_params`` lays them out
        at ``fsdp``): the same tree of the same shapes and dtypes it was lowered for."""
        return self.devices == tuple(devices) and self.fsdp == fsdp and \
            same_shapes(self.params, params)


def program_params(model, devices, fsdp: int = 1):
    """``jax.ShapeDtypeStruct``s of the params as the host's program takes them: their
    global shapes, with their shardings on the host's mesh (``sharding.shaped``)."""
    the_mesh = sharding.mesh(devices, fsdp)
    return sharding.shaped(model.params, sharding.param_shardings(model.params, sharding.layout_of(model.params, fsdp),
                                                                  the_mesh), model.param_dtype)


def place_params(model, devices, fsdp: int = 1):
    """The model's params on ``devices`` as the host's program takes them, on the host's
    mesh (``sharding.place``: each device its shard, or at ``fsdp`` 1 its whole copy)."""
    the_mesh = sharding.mesh(devices, fsdp)
    shardings = sharding.param_shardings(model.params, sharding.layout_of(model.params, fsdp), the_mesh)
    return sharding.place(model.params, shardings, model.param_dtype)


def compile_sampler(model, spec: ProgramSpec, devices, *, index_key: str | None = None,
                    lowered=None) -> SamplerProgram:
    """The host's sampler of ``spec`` for ``devices`` (one program over the host's mesh,
    ``lower_sampler``), lowered from shapes alone and compiled, or loaded from the
    executable cache (``compile_cache.load_or_compile``).

    ``model``'s params may be arrays or ``ShapeDtypeStruct``s (``load(abstract=True)``):
    only their shapes and dtypes are read, so this can run on a thread while the weights
    load. ``index_key``: the ``compile_cache.index_key`` of the program, under which
    ``indexed_sampler`` finds the executable next time without lowering it. ``lowered``:
    the program ``lower_sampler`` made of these same arguments, when the caller has it already."""
    jax_events.COMPILES.install()
    started = time.perf_counter()
    devices = list(devices)
    compiles = jax_events.COMPILES.count_here()
    if lowered is None:
        lowered = lower_sampler(model, spec, devices)
    params = program_params(model, devices, spec.fsdp)
    compiled, from_cache = compile_cache.load_or_compile(lowered, devices,
                                                         index=(index_key, params) if index_key else None)
    return SamplerProgram(compiled, params, tuple(devices), from_cache,
                          jax_events.COMPILES.count_here() - compiles, time.perf_counter() - started, fsdp=spec.fsdp)


def indexed_sampler(index_key: str, devices, fsdp: int = 1) -> SamplerProgram | None:
    """The sampler ``compile_sampler(..., index_key=index_key)`` made on an earlier run of
    this host, loaded from the executable cache without lowering anything; None if there
    is none (or no cache). ``fsdp``: what the key's description says."""
    found = load_indexed_program(index_key, devices)
    if found is None:
        return None
    compiled, params, compiles, seconds = found
    return SamplerProgram(compiled, params, tuple(devices), True, compiles, seconds, lowered=False, fsdp=fsdp)


def load_indexed_program(index_key: str, devices) -> tuple | None:
    """(executable, its params' shapes, compiles it took, seconds) of the program an earlier
    run of this host compiled under ``index_key`` (``compile_cache.load_indexed``); None if
    there is none."""
    jax_events.COMPILES.install()
    started = time.perf_counter()
    compiles = jax_events.COMPILES.count_here()
    found = compile_cache.load_indexed(index_key, list(devices))
    if found is None:
        return None
    return (*found, jax_events.COMPILES.count_here() - compiles, time.perf_counter() - started)


def lower_sampler(model, spec: ProgramSpec, devices):
    """The host's sampler of ``spec`` for ``devices`` as one program over the host's mesh
    (``sharding.mesh``: axes data and fsdp), lowered from the shapes of ``model``'s params
    and of a batch (``compile_sampler``): the batch of D x per-device batch images split
    over the D devices, so each computes its own; the weights of the sharded components
    split over groups of ``spec.fsdp`` of them, every other weight (all of them at
    ``fsdp`` 1) whole on every device."""
    import jax
    import jax.numpy as jnp

    devices = list(devices)
    attention_lib.check_platform(spec.attention, devices[0].platform)
    the_mesh = sharding.mesh(devices, spec.fsdp)
    params = program_params(model, devices, spec.fsdp)
    n = len(devices) * spec.per_device_batch
    ids = model.family.tokenize(model, [""]).shape[1:]
    one = sharding.batch_sharding(the_mesh, 1)
    images = sharding.batch_sharding(the_mesh, 4)
    fn = jax.jit(per_device_program(model, spec, the_mesh), out_shardings=(images, images) if spec.latents else images)
    ids_struct = jax.ShapeDtypeStruct((n, *ids), jnp.int32, sharding=sharding.batch_sharding(the_mesh, 1 + len(ids)))
    words = jax.ShapeDtypeStruct((n,), jnp.uint32, sharding=one)
    return fn.lower(params, ids_struct, ids_struct, jax.ShapeDtypeStruct((n,), jnp.float32, sharding=one), words,
                    words, words)


def per_device_program(model, spec: ProgramSpec, the_mesh):
    """The sample function of ``spec`` as the host's program runs it over ``the_mesh``. At
    ``fsdp`` 1 it is written per device (``shard_map`` over every axis of the mesh: each
    device runs the same program on its own rows with its whole copy of the weights), so
    the program a device runs does not depend on how many devices the host has: a 2x2 run
    and a 1x4 run compute every image with the same instructions, byte for byte. At N > 1
    the weights are split over the fsdp axis and the compiler partitions the program over
    the mesh (sharding annotations)."""
    import jax
    from jax.sharding import PartitionSpec

    platform = the_mesh.devices.flat[0].platform
    if spec.fsdp > 1:
        return sampler.make_sample_fn(model, spec, platform, the_mesh)
    rows = PartitionSpec(tuple(the_mesh.axis_names))
    return jax.shard_map(sampler.make_sample_fn(model, spec, platform), mesh=the_mesh,
                         in_specs=(PartitionSpec(),) + (rows,) * 6, out_specs=(rows, rows) if spec.latents else rows,
                         check_vma=False)


class Generator:
    """The sampler of ``spec`` on ``devices`` (default: every local device), with the
    model's weights on them. ``program``: the sampler ``compile_sampler`` made of the same
    spec (e.g. from an abstract model while the weights loaded); it is used when it takes
    exactly these params on these devices, else the sampler is compiled here. ``params``:
    the model's params already on ``devices`` as the program takes them (``place_params``;
    generators of one model may share them)."""

    def __init__(self, model, spec: ProgramSpec, devices=None, *, params=None,
                 program: SamplerProgram | None = None):
        import jax

        jax_events.COMPILES.install()
        self.model, self.spec = model, spec
        self.width, self.height, self.steps = spec.width, spec.height, spec.steps
        self.latents = spec.latents
        self.guided = spec.guided  # False: the guidance-free program, which reads no negative prompt
        self.devices = list(devices or jax.local_devices())
        attention_lib.check_platform(spec.attention, self.devices[0].platform)
        self.per_device_batch = spec.per_device_batch
        self.batch_size = len(self.devices) * spec.per_device_batch
        self.fsdp = spec.fsdp
        self.decode_batch = spec.decode_batch
        self._mesh = sharding.mesh(self.devices, spec.fsdp)
        started = time.perf_counter()
        self.params = place_params(model, self.devices, spec.fsdp) if params is None else params
        jax.block_until_ready(self.params)
        self.transfer_s = time.perf_counter() - started  # putting the weights on the devices
        self.program_given = program is not None and program.takes(self.params, self.devices, spec.fsdp)
        if not self.program_given:  # none given, or made for other shapes
            program = compile_sampler(model, spec, self.devices)
        self.program = program
        # from_cache: loaded from this host's executable cache (``compile_cache.enable``);
        # sampler_compiles: the backend compilations that building the sampler took
        self.compiled, self.from_cache, self.sampler_compiles = program.compiled, program.from_cache, program.compiles
        self.sampler_lowered = program.lowered  # False: found through the executable cache's index

    def tokenize(self, prompts: list[str]) -> np.ndarray:
        """CLIP token ids, padded and truncated to the tokenizer's length."""
        return self.model.family.tokenize(self.model, prompts)

    def truncated(self, prompts: list[str]) -> list[bool]:
        """Whether each prompt is longer than the text encoder takes (``tokenize`` cuts it)."""
        return self.model.family.truncated(self.model, prompts)

    def batch(self, prompts, negatives, guidance, seeds, image_indices) -> Batch:
        """Device inputs for one step: tokenised prompts and each image's seed words and index."""
        from pipeline.core import keys

        words = np.array([keys.seed_words(s) for s in seeds], np.uint32).reshape(-1, 2)
        prompt_ids = self.tokenize(list(prompts))
        negative_ids = self.tokenize(list(negatives)) if self.guided else np.zeros_like(prompt_ids)
        return Batch(prompt_ids, negative_ids, np.asarray(guidance, np.float32),
                     words[:, 0], words[:, 1], np.asarray(image_indices, np.uint32))

    def batch_of(self, rows) -> Batch:
        """A full batch from (prompt, negative prompt, guidance, seed, image index) rows:
        ``None`` rows and the places after the last row are padding rows."""
        if len(rows) > self.batch_size:
            raise ValueError(f"a batch holds {self.batch_size} images, got {len(rows)} rows")
        rows = [PADDING_ROW if row is None else row for row in rows]
        return self.batch(*zip(*rows, *[PADDING_ROW] * (self.batch_size - len(rows))))

    def padding_batch(self) -> Batch:
        """A batch of nothing: its outputs are never written."""
        return self.batch_of([])

    def warm_up(self) -> int:
        """Run one padding batch (the first execution); returns the process's compile count
        after it, from which later compilations are counted."""
        self(self.padding_batch())
        return jax_events.COMPILES.count()

    def _device_shaped(self, batch: Batch) -> tuple:
        """The batch's arrays as the program takes them: the whole batch split over the
        mesh's devices, each its own per-device batch of rows."""
        import jax

        arrays = [np.asarray(a) for a in dataclasses.astuple(batch)]
        return tuple(jax.device_put(a, sharding.batch_sharding(self._mesh, a.ndim)) for a in arrays)

    def dispatch(self, batch: Batch):
        """Start a device step; returns the device array, or (images, latents) with
        ``latents`` (asynchronous)."""
        if len(batch.prompt_ids) != self.batch_size:
            raise ValueError(f"a batch holds {self.batch_size} images, got {len(batch.prompt_ids)}")
        return self.compiled(self.params, *self._device_shaped(batch))

    def wait(self, out) -> None:
        """Block until the device step ``dispatch`` started is done (no host copy)."""
        import jax

        jax.block_until_ready(out)

    def _host(self, array) -> np.ndarray:
        return np.asarray(array)

    def __call__(self, batch: Batch) -> np.ndarray:
        """uint8 images [N, height, width, 3] of one batch, in batch order (latents, if
        any, stay on the devices)."""
        out = self.dispatch(batch)
        return self._host(out[0] if self.latents else out)

    def fetch(self, out) -> tuple[np.ndarray, np.ndarray | None]:
        """The host copy of what ``dispatch`` returned: (uint8 images [N, height, width, 3],
        float32 final latents [N, C, height/f, width/f] or None without ``latents``), in
        batch order. Blocks until the device step is done."""
        if not self.latents:
            return self._host(out), None
        return self._host(out[0]), self._host(out[1])

    def generate(self, batch: Batch) -> tuple[np.ndarray, np.ndarray | None]:
        """``fetch(dispatch(batch))``: one batch, waited for."""
        return self.fetch(self.dispatch(batch))
