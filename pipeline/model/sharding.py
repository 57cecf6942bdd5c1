"""FSDP inside a host: the weights sharded over groups of N of its chips, gathered as used.

``--fsdp N`` lays a host's D devices out as a mesh of D/N rows of N (axes ``data`` and
``fsdp``). Every device still computes its own images: the batch is split over all D
devices (its leading axis over both mesh axes), so a device's batch, the slice layout
and every image's key mean what they mean in a replicated run. A sharded weight is split over the
``fsdp`` axis (replicated down ``data``), and XLA's SPMD partitioner gathers each one
where the program uses it (a scanned stack's blocks inside its loop: layer by layer).
Hosts exchange nothing: the mesh is one host's devices. ``--fsdp 1`` is the same kind of
program on a (D, 1) mesh, every weight whole on every device (the replicated run):
``pipeline.generate.generator`` lowers both the same way.

The rule (``sharded_components``, written down here and recorded in run.json): with N > 1
the denoiser (UNet or transformer) is sharded, and so is every text encoder of at least
``ENCODER_SHARDED_FROM`` bytes of weights (FLUX.1's T5-XXL, 9.5 GB in bf16; not CLIP-L,
0.25 GB); the VAE is replicated (it is small and decodes once per image). Inside a
sharded component, a weight of at least ``MIN_SHARDED`` elements is split along the
larger of its last two axes that N divides (a matrix's rows or columns, a convolution's
input or output channels; never the blocks axis of a scanned stack); smaller ones
(biases, norms) are replicated: sharding them saves little and costs a gather each.
The rule reads the model's configs and the settings alone, so the plan and every host
find the same.

Weights go straight to their shards (``place``): each device receives its slice of the
host's (memory-mapped) array, so no device ever holds a whole sharded weight at rest,
and the host copies at most a shard at a time (to cast it, when the run's dtype is not
the stored one).
"""
from __future__ import annotations

import dataclasses

import numpy as np

DATA, FSDP = "data", "fsdp"
MIN_SHARDED = 2 ** 8  # elements: a matrix smaller than this is replicated (a gather costs more than it saves)
ENCODER_SHARDED_FROM = 2 ** 30  # bytes: a text encoder this large is sharded too
DENOISERS = ("unet", "transformer")


def check_fsdp(fsdp: int, local_devices: int) -> None:
    """ValueError unless ``fsdp`` (N) divides the host's ``local_devices``."""
    if not isinstance(fsdp, int) or isinstance(fsdp, bool) or fsdp < 1:
        raise ValueError(f"--fsdp must be a whole number >= 1 or auto, got {fsdp!r}")
    if local_devices % fsdp:
        raise ValueError(f"--fsdp {fsdp} must divide the devices of a host ({local_devices}): the weights are "
                         f"sharded over groups of {fsdp} of them; possible: "
                         f"{', '.join(str(n) for n in divisors(local_devices))}")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def sharded_components(component_bytes: dict[str, int], fsdp: int) -> tuple[str, ...]:
    """The components whose weights are sharded at ``--fsdp fsdp`` (pure; the module's
    rule): none at 1; else the denoiser, and each text encoder of at least
    ``ENCODER_SHARDED_FROM`` bytes."""
    if fsdp == 1:
        return ()
    return tuple(sorted(name for name, size in component_bytes.items()
                        if name in DENOISERS or (name.startswith("text_encoder") and size >= ENCODER_SHARDED_FROM)))


def leaf_axis(shape: tuple[int, ...], fsdp: int) -> int | None:
    """The axis a weight of ``shape`` is split along over ``fsdp`` devices: the larger of
    its last two axes that ``fsdp`` divides (the last on a tie); None (replicated) below
    ``MIN_SHARDED`` elements, for a vector, or when ``fsdp`` divides neither (pure)."""
    if fsdp == 1 or len(shape) < 2 or int(np.prod(shape)) < MIN_SHARDED:
        return None
    candidates = [axis for axis in (len(shape) - 2, len(shape) - 1) if shape[axis] % fsdp == 0]
    if not candidates:
        return None
    return max(candidates, key=lambda axis: (shape[axis], axis))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a host's program lays its weights and batch out: the mesh and, per component,
    whether its weights are sharded."""
    fsdp: int
    sharded: tuple[str, ...]  # components whose weights are split over the fsdp axis

    def describe(self, component_bytes: dict[str, int]) -> dict:
        """{component: "sharded over N devices" | "replicated", with its bytes}: for
        run.json and the run's log."""
        return {name: {"weights_gib": round(size / 2 ** 30, 3),
                       "placement": f"sharded over {self.fsdp} devices" if name in self.sharded else "replicated"}
                for name, size in sorted(component_bytes.items())}


def component_bytes(params) -> dict[str, int]:
    """{component: bytes of its weights} of a params tree (arrays or ShapeDtypeStructs)."""
    import jax

    return {name: int(sum(np.prod(leaf.shape, dtype=np.int64) * np.dtype(leaf.dtype).itemsize
                          for leaf in jax.tree_util.tree_leaves(tree)))
            for name, tree in params.items()}


def device_bytes(params, fsdp: int, dtype=None) -> int:
    """The bytes of weights each device holds at ``--fsdp fsdp``, as ``shaped`` lays the
    params out (floating leaves in ``dtype`` when given): a sharded leaf's 1/fsdp, a
    replicated leaf whole. What a program's arguments take per device, without compiling it."""
    import jax

    from pipeline.model.shapes import struct

    layout = layout_of(params, fsdp)
    total = 0
    for component, tree in params.items():
        for leaf in jax.tree_util.tree_leaves(struct(tree, dtype)):
            size = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
            split = component in layout.sharded and leaf_axis(tuple(leaf.shape), fsdp) is not None
            total += size // fsdp if split else size
    return total


def layout_of(params, fsdp: int) -> Layout:
    return Layout(fsdp, sharded_components(component_bytes(params), fsdp))


def mesh(devices, fsdp: int):
    """The host's devices as a (D / N, N) mesh with axes (data, fsdp)."""
    import jax

    devices = list(devices)
    check_fsdp(fsdp, len(devices))
    return jax.sharding.Mesh(np.array(devices).reshape(len(devices) // fsdp, fsdp), (DATA, FSDP))


def param_shardings(params, layout: Layout, the_mesh):
    """A NamedSharding per weight: split along ``leaf_axis`` over the fsdp axis in a
    sharded component, else replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def spec(component, leaf):
        axis = leaf_axis(tuple(leaf.shape), layout.fsdp) if component in layout.sharded else None
        if axis is None:
            return NamedSharding(the_mesh, PartitionSpec())
        names = [None] * len(leaf.shape)
        names[axis] = FSDP
        return NamedSharding(the_mesh, PartitionSpec(*names))

    return {component: jax.tree_util.tree_map(lambda leaf, c=component: spec(c, leaf), tree)
            for component, tree in params.items()}


def batch_sharding(the_mesh, ndim: int):
    """The batch's leading axis split over every device of the mesh (data, then fsdp): a
    device holds its own images' rows, in device order."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(the_mesh, PartitionSpec((DATA, FSDP), *[None] * (ndim - 1)))


def place(params, shardings, dtype=None):
    """The params on the mesh, each device given its own slice of each host array (a
    memory-mapped weight is read shard by shard; no device holds a whole sharded weight);
    floating weights cast to ``dtype`` shard by shard when given."""
    import jax
    import jax.numpy as jnp

    def put(leaf, sharding):
        host = leaf if hasattr(leaf, "dtype") and hasattr(leaf, "shape") else np.asarray(leaf)
        cast = dtype is not None and jnp.issubdtype(host.dtype, jnp.floating) and host.dtype != dtype

        def shard(index):
            part = np.asarray(host[index])
            return part.astype(dtype) if cast else part

        return jax.make_array_from_callback(tuple(host.shape), sharding, shard)

    return jax.tree_util.tree_map(put, params, shardings)


def shaped(params, shardings, dtype=None):
    """``jax.ShapeDtypeStruct``s of the params as ``place`` lays them out (for lowering)."""
    import jax

    from pipeline.model.shapes import struct

    return jax.tree_util.tree_map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                                  struct(params, dtype), shardings)
