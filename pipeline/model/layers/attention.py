"""The attention seam: one place that decides how every network's attention runs.

Each of promptmill's own Flax networks (the SD UNets, the VAE decoder, CLIP, the FLUX.1,
FLUX.2 and Z-Image transformers, the scorers' towers) computes its projections itself and
calls ``compute`` for the core softmax(Q K^T) V, which goes through the seam that ``use``
opened on the tracing thread (``xla`` outside one). The core has these kernels:

- ``xla``: the whole [batch, heads, queries, keys] matrix, as diffusers computes it.
- ``chunked``: the same per query row, one block of query rows at a time (a ``lax.map``
  over blocks), so only one block's scores are alive. It is exact: every row's softmax
  sees all of its keys at once (no online rescaling), in the module's dtype as ``xla``.
- ``pallas``: the Pallas TPU flash-attention kernel of ``jax.experimental.pallas.ops.tpu``
  (online softmax in float32, keys streamed through VMEM); on a CPU it runs in Pallas'
  interpret mode, for tests only.
- ``cudnn``: cuDNN's fused attention through ``jax.nn.dot_product_attention`` on GPU.

The run setting (``IMPLEMENTATIONS``) names what the user asked for; ``choose`` resolves
it to a kernel per call site from static facts only (platform, shapes, dtype, budget),
so the same setting on the same model, size and per-device batch always compiles the
same program. The kernel can change float bits, hence the setting is part of a run.

Key lengths: a call may hide each batch item's keys from a length on (``key_lengths``, int
[batch]: the keys at and beyond it weigh exactly 0), as a padded batch of sequences of
several lengths needs (Z-Image's captions). Every kernel takes them: ``xla`` and
``chunked`` mask the scores (the hidden keys' scores are the dtype's lowest value, as
torch's boolean masks make them), the Pallas kernel through its segment ids, cuDNN through
``jax.nn.dot_product_attention``'s ``key_value_seq_lengths``. Each item keeps at least one
key: a length below 1 is the caller's bug.

Causal attention (CLIP's text encoder): query i sees keys 0..i only (``causal``), in every
kernel: ``xla`` and ``chunked`` mask the scores as the key lengths do, the Pallas kernel and
cuDNN through their own causal masks.

Layout: the seam always splits heads as [batch, tokens, heads, head_dim] (cuDNN's).
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading

from pipeline.core.choices import ATTENTIONS

# The --attention choices: what a run asks for
IMPLEMENTATIONS = ATTENTIONS
# What one attention call runs, as ``choose`` resolves a choice
KERNELS = ("xla", "chunked", "pallas", "cudnn")

# auto: the Pallas kernel on TPU from this many query and key tokens on. MaxDiffusion's
# default flash_min_seq_length: on shorter sequences its docs find the kernel's overhead
# outweighs its gain over XLA's dot-product attention.
FLASH_MIN_TOKENS = 4096
# The most bytes of attention scores (batch x heads x queries x keys x dtype) that one call
# may hold at once, by platform: auto chunks a call above it, and chunked sizes its blocks
# to it. On a CPU, blocks that stay in cache are faster than the whole matrix, not only
# smaller (XLA:CPU, float32, CFG batch 2, against diffusers' own attention: SD 1.5's
# 4096-token transformer block 1.54 -> 0.98 s, its VAE's 4096-token block 0.94 -> 0.23 s,
# the tiny UNet at 128x128 2.78 -> 0.78 s; 4 MiB blocks were as fast, 64 and 256 MiB ones
# slower, 1 MiB ones, of 2 rows, slower still). The UNet call of SD 1.5 at 1024x1024 then
# needs 1.16 GiB of temp (17.8 GiB whole). Elsewhere chunking only bounds memory, so its
# blocks are large.
DEFAULT_BUDGET_BYTES = {"cpu": 16 * 2 ** 20, "gpu": 256 * 2 ** 20, "tpu": 256 * 2 ** 20}
# Query and key block of the Pallas kernel, in tokens (a multiple of 128, TPU lane width)
DEFAULT_BLOCK_TOKENS = 512
_LANES = 128
# cuDNN's fused attention: head dim at most 128 and a multiple of 8, 16-bit inputs
# (jax's check allows 256 on Hopper; 128 holds on every GPU it supports)
_CUDNN_MAX_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Call:
    """One attention call as the seam traced it, and the kernel it ran."""
    site: str  # the network's: "unet", "vae", "text_encoder", "transformer", ...
    batch: int
    q_tokens: int
    kv_tokens: int
    heads: int
    head_dim: int
    dtype: str
    kernel: str


def summary(calls: list[Call]) -> list[dict]:
    """The distinct calls of a traced program, each with how many times it ran, in the
    order first seen: one line per call site kind for a log or a benchmark report."""
    counts: dict[Call, int] = {}
    for call in calls:
        counts[call] = counts.get(call, 0) + 1
    return [{**dataclasses.asdict(call), "count": count} for call, count in counts.items()]


def platform_of(name: str) -> str:
    """"cpu", "gpu" or "tpu" for a jax platform or backend name ("cuda", "rocm": gpu)."""
    name = name.lower()
    if name in ("cuda", "rocm", "gpu"):
        return "gpu"
    if name in ("cpu", "tpu"):
        return name
    raise ValueError(f"attention: unknown platform {name!r}")


def score_bytes(batch: int, heads: int, q_tokens: int, kv_tokens: int, dtype_bytes: int) -> int:
    """Bytes of one call's whole attention matrix."""
    return batch * heads * q_tokens * kv_tokens * dtype_bytes


def cudnn_fits(head_dim: int, dtype_bytes: int) -> bool:
    """Whether cuDNN's fused attention takes this head dim and dtype."""
    return dtype_bytes == 2 and head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM


def choose(requested: str, platform: str, q_tokens: int, kv_tokens: int, heads: int, head_dim: int, *, batch: int,
           dtype_bytes: int, budget_bytes: int | None = None) -> str:
    """The kernel (one of ``KERNELS``) that one attention call runs; pure.

    - ``xla`` and ``chunked`` are taken as asked.
    - ``flash``: the Pallas kernel on TPU (and, interpreted, on CPU); on GPU cuDNN where
      it takes the head dim and dtype, else what ``auto``'s memory rule picks.
    - ``auto``: the Pallas kernel on TPU for at least ``FLASH_MIN_TOKENS`` query and key
      tokens; cuDNN on GPU where it fits; otherwise ``chunked`` when the whole matrix
      would exceed ``budget_bytes`` (None: the platform's ``DEFAULT_BUDGET_BYTES``),
      else ``xla``.
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}, got {requested!r}")
    platform = platform_of(platform)
    if requested in ("xla", "chunked"):
        return requested
    if platform in ("tpu", "cpu") and requested == "flash":
        return "pallas"
    if platform == "tpu" and min(q_tokens, kv_tokens) >= FLASH_MIN_TOKENS:
        return "pallas"
    if platform == "gpu" and cudnn_fits(head_dim, dtype_bytes):
        return "cudnn"
    budget = DEFAULT_BUDGET_BYTES[platform] if budget_bytes is None else budget_bytes
    return "chunked" if score_bytes(batch, heads, q_tokens, kv_tokens, dtype_bytes) > budget else "xla"


def check_platform(implementation: str, platform: str) -> None:
    """ValueError for an implementation that must not run a job on ``platform``: ``flash``
    on a CPU would run the Pallas kernel in Pallas' interpreter, correct but orders of
    magnitude slower than ``xla`` or ``chunked``."""
    if implementation == "flash" and platform_of(platform) == "cpu":
        raise ValueError("--attention flash needs a TPU (Pallas kernels) or a GPU (cuDNN); on CPU devices it "
                         "would only run interpreted, far slower than auto, xla or chunked: use one of those")


# ---- kernels: q, k, v are [batch, tokens, heads, head_dim]; scores are multiplied by
# ``scale`` unless it is None (a caller that scales q and k beforehand)

def _hide(scores, key_lengths, causal: bool = False, first_query=0):
    """``scores`` [batch, heads, queries, keys] with each item's keys from its length on,
    and with ``causal`` each query's later keys (the queries numbered from ``first_query``),
    at the dtype's lowest value (weight 0 after the softmax); as they are without either."""
    import jax.numpy as jnp

    if key_lengths is not None:
        shown = jnp.arange(scores.shape[-1])[None, :] < jnp.asarray(key_lengths)[:, None]
        scores = jnp.where(shown[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
    if causal:
        queries = first_query + jnp.arange(scores.shape[-2])
        seen = jnp.arange(scores.shape[-1])[None, :] <= queries[:, None]
        scores = jnp.where(seen[None, None], scores, jnp.finfo(scores.dtype).min)
    return scores


def _xla(q, k, v, scale, heads_first: bool = False, key_lengths=None, *, causal: bool = False):
    """diffusers' own arithmetic: scores, scale and softmax in the inputs' dtype.

    ``heads_first`` (on CPU devices): q, k and v are laid out [batch, heads, tokens,
    head_dim] before the two products, as diffusers' own attention lays them out. XLA:CPU
    (jax 0.10.2) runs the products of [batch, tokens, heads, head_dim] operands several
    times slower where heads are many and small: 11.5 ms against 1.8 ms for 2 x 256
    tokens x 8 heads of 4 (the tiny UNet's), which made the tiny UNet call 3x slower
    than diffusers' attention. The same products and softmax, so within float rounding
    of the other layout; TPU and GPU programs keep theirs."""
    import flax.linen as nn
    import jax.numpy as jnp

    if heads_first:
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    else:
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if scale is not None:
        scores = scores * scale
    scores = _hide(scores, key_lengths, causal)
    if heads_first:
        return jnp.einsum("bhqk,bhkd->bhqd", nn.softmax(scores, axis=-1), v).transpose(0, 2, 1, 3)
    return jnp.einsum("bhqk,bkhd->bqhd", nn.softmax(scores, axis=-1), v)


def query_blocks(batch: int, heads: int, q_tokens: int, kv_tokens: int, dtype_bytes: int,
                 budget_bytes: int) -> tuple[int, int]:
    """(blocks, rows per block) of ``chunked``: the fewest blocks of query rows whose
    scores each fit ``budget_bytes`` (one row at least), rows spread as evenly as can be."""
    row_bytes = score_bytes(batch, heads, 1, kv_tokens, dtype_bytes)
    blocks = -(-q_tokens // max(1, min(q_tokens, budget_bytes // row_bytes)))
    return blocks, -(-q_tokens // blocks)


def _chunked(q, k, v, scale, budget_bytes: int, heads_first: bool = False, *, key_lengths=None,
             causal: bool = False):
    """``_xla``'s arithmetic, one block of query rows at a time (``query_blocks``).

    A ``lax.map`` keeps one block's scores alive: on XLA:CPU (jax 0.10.2) a Python loop
    over 16 blocks of a 16384-token call needed 1.08 GiB of temp, the map 0.12 GiB. Keys,
    values and query blocks are laid out [batch, heads, tokens, head_dim] before the loop,
    so its body runs two plain batched matmuls and copies nothing. The queries are padded
    to whole blocks; padded rows are computed and dropped.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    batch, q_tokens, heads, head_dim = q.shape
    blocks, rows = query_blocks(batch, heads, q_tokens, k.shape[1], q.dtype.itemsize, budget_bytes)
    if blocks == 1:
        return _xla(q, k, v, scale, heads_first, key_lengths, causal=causal)
    keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def block(args):  # [batch, heads, rows, head_dim], the block's first query
        queries, first = args
        scores = jnp.einsum("bhqd,bhkd->bhqk", queries, keys)
        if scale is not None:
            scores = scores * scale
        return jnp.einsum("bhqk,bhkd->bhqd", nn.softmax(_hide(scores, key_lengths, causal, first), axis=-1), values)

    padded = jnp.pad(q, ((0, 0), (0, blocks * rows - q_tokens), (0, 0), (0, 0)))
    stacked = padded.reshape(batch, blocks, rows, heads, head_dim).transpose(1, 0, 3, 2, 4)
    out = jax.lax.map(block, (stacked, jnp.arange(blocks) * rows))  # [blocks, batch, heads, rows, head_dim]
    out = out.transpose(1, 0, 3, 2, 4).reshape(batch, blocks * rows, heads, v.shape[-1])
    return out[:, :q_tokens]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _block(padded: int, most: int) -> int:
    """The largest multiple of the lane width that divides ``padded`` and is <= ``most``."""
    return max(b for b in range(_LANES, max(_LANES, most) + 1, _LANES) if padded % b == 0)


def _pallas(q, k, v, scale, block_tokens: int, interpret: bool, *, key_lengths=None, causal: bool = False):
    """The Pallas TPU flash-attention kernel, shapes padded to what it takes.

    Its blocks must divide the key length and be multiples of 128 when keys are streamed,
    and a head dim above 128 must be a multiple of 128. Queries and keys are padded to
    whole blocks, padded keys masked out through segment ids (their scores get the
    kernel's mask value, so they weigh exactly 0), and head dims zero-padded (zeros add
    nothing to q.k and give zero output columns, which are dropped).
    """
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    batch, q_tokens, heads, head_dim = q.shape
    kv_tokens = k.shape[1]
    dim = head_dim if head_dim <= _LANES else _round_up(head_dim, _LANES)
    q_padded, kv_padded = _round_up(q_tokens, _LANES), _round_up(kv_tokens, _LANES)
    block_q, block_k = _block(q_padded, block_tokens), _block(kv_padded, block_tokens)

    def layout(x, tokens):  # [B, T, H, D] -> [B, H, T', D'], zero-padded
        x = jnp.pad(x, ((0, 0), (0, tokens - x.shape[1]), (0, 0), (0, dim - x.shape[3])))
        return x.transpose(0, 2, 1, 3)

    segments = None
    if kv_padded != kv_tokens or key_lengths is not None:  # hidden keys in a segment of their own
        shown = kv_tokens if key_lengths is None else jnp.minimum(jnp.asarray(key_lengths), kv_tokens)
        segments = fa.SegmentIds(q=jnp.ones((batch, q_padded), jnp.int32),
                                 kv=(jnp.arange(kv_padded)[None, :] < jnp.reshape(shown, (-1, 1))).astype(jnp.int32)
                                 * jnp.ones((batch, 1), jnp.int32))
    sizes = fa.BlockSizes(block_q=block_q, block_k_major=block_k, block_k=block_k, block_b=1)
    # interpret=True is Pallas' plain HLO interpreter (a scan over the grid); the
    # TPU-simulating InterpretParams mode is about 100x slower per call on a CPU
    mode = pltpu.force_tpu_interpret_mode(True) if interpret else contextlib.nullcontext()
    with mode:
        out = fa.flash_attention(layout(q, q_padded), layout(k, kv_padded), layout(v, kv_padded),
                                 segment_ids=segments, sm_scale=1.0 if scale is None else float(scale),
                                 block_sizes=sizes, causal=causal)
    return out.transpose(0, 2, 1, 3)[:, :q_tokens, :, :v.shape[-1]]


def _cudnn(q, k, v, scale, key_lengths=None, *, implementation: str | None = "cudnn", causal: bool = False):
    """cuDNN's fused attention (``implementation`` None: the same call on XLA, for tests
    off a GPU); ``key_lengths`` as cuDNN's padding mask, ``key_value_seq_lengths``."""
    import jax
    import jax.numpy as jnp

    lengths = None if key_lengths is None else jnp.asarray(key_lengths, jnp.int32)
    query_lengths = None if lengths is None else jnp.full_like(lengths, q.shape[1])
    return jax.nn.dot_product_attention(q, k, v, scale=1.0 if scale is None else scale, is_causal=causal,
                                        query_seq_lengths=query_lengths, key_value_seq_lengths=lengths,
                                        implementation=implementation)


def _per_device(kernel, mesh, *arrays):
    """``kernel(*arrays)`` run on each device's own rows of the batch (``shard_map`` over
    every axis of ``mesh``): in a program partitioned over a mesh (``--fsdp``), XLA cannot
    partition a Pallas (Mosaic) kernel by itself, but attention never mixes rows."""
    import jax
    from jax.sharding import PartitionSpec

    rows = PartitionSpec(tuple(mesh.axis_names))
    return jax.shard_map(kernel, mesh=mesh, in_specs=(rows,) * len(arrays), out_specs=rows,
                         check_vma=False)(*arrays)


def attend(q, k, v, scale, kernel: str, *, budget_bytes: int = DEFAULT_BUDGET_BYTES["cpu"],
           block_tokens: int = DEFAULT_BLOCK_TOKENS, interpret: bool = False, mesh=None,
           heads_first: bool = False, key_lengths=None, causal: bool = False):
    """softmax(q k^T [* scale]) v with ``kernel``; q, k, v and the result are
    [batch, tokens, heads, head_dim]. ``budget_bytes``: chunked's block, in bytes of
    scores; ``block_tokens``: the Pallas kernel's block; ``interpret``: run the Pallas
    kernel in interpret mode (on a CPU); ``mesh``: the mesh a partitioned program runs
    over (the Pallas kernel then runs per device, ``_per_device``); ``heads_first``:
    ``xla``'s CPU layout (``_xla``); ``key_lengths``: int [batch], each item's keys from its
    length on hidden; ``causal``: each query sees the keys up to its own position (see the
    module docstring)."""
    if kernel == "xla":
        return _xla(q, k, v, scale, heads_first, key_lengths, causal=causal)
    if kernel == "chunked":
        return _chunked(q, k, v, scale, budget_bytes, heads_first, key_lengths=key_lengths, causal=causal)
    if kernel == "pallas":
        if mesh is not None:
            if key_lengths is None:
                return _per_device(lambda a, b, c: _pallas(a, b, c, scale, block_tokens, interpret, causal=causal),
                                   mesh, q, k, v)
            return _per_device(lambda a, b, c, n: _pallas(a, b, c, scale, block_tokens, interpret, key_lengths=n,
                                                          causal=causal), mesh, q, k, v, key_lengths)
        return _pallas(q, k, v, scale, block_tokens, interpret, key_lengths=key_lengths, causal=causal)
    if kernel == "cudnn":
        return _cudnn(q, k, v, scale, key_lengths, causal=causal)
    raise ValueError(f"attention kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")


# ---- the interceptor, and the seam our own networks call

_ACTIVE = threading.local()  # the seam ``use`` opened on this thread, while its block runs


@contextlib.contextmanager
def record():
    """Yields a list that receives one ``Call`` per attention call traced on this thread
    while the block runs, by whichever seam traces it: what a compiled program's attention
    calls ran, seen from outside the function that opened the seam."""
    calls: list[Call] = []
    outer = getattr(_ACTIVE, "recorders", ())
    _ACTIVE.recorders = (*outer, calls)
    try:
        yield calls
    finally:
        _ACTIVE.recorders = outer


def compute(site: str, q, k, v, scale, key_lengths=None, *, causal: bool = False):
    """softmax(q k^T [* scale]) v for one attention call of promptmill's own networks, q, k,
    v and the result [batch, tokens, heads, head_dim]: through the seam active on this
    thread (``use``: its implementation picks the kernel and the call is recorded under
    ``site``), else ``xla``. Call it while the program is traced. ``key_lengths``,
    ``causal``: see ``attend``."""
    seam = getattr(_ACTIVE, "seam", None)
    if seam is None:
        return _xla(q, k, v, scale, key_lengths=key_lengths, causal=causal)
    return seam.core(site, q, k, v, scale, key_lengths, causal=causal)


@dataclasses.dataclass(frozen=True)
class _Seam:
    implementation: str
    platform: str
    budget_bytes: int
    block_tokens: int
    calls: list
    mesh: object = None  # the mesh of a partitioned program (``use``)

    def core(self, site, q, k, v, scale, key_lengths=None, *, causal: bool = False):
        batch, q_tokens, heads, head_dim = q.shape
        kernel = choose(self.implementation, self.platform, q_tokens, k.shape[1], heads, head_dim, batch=batch,
                        dtype_bytes=q.dtype.itemsize, budget_bytes=self.budget_bytes)
        call = Call(site, batch, q_tokens, k.shape[1], heads, head_dim, str(q.dtype), kernel)
        self.calls.append(call)
        for recorder in getattr(_ACTIVE, "recorders", ()):
            recorder.append(call)
        return attend(q, k, v, scale, kernel, budget_bytes=self.budget_bytes, block_tokens=self.block_tokens,
                      interpret=self.platform == "cpu", mesh=self.mesh, heads_first=self.platform == "cpu",
                      key_lengths=key_lengths, causal=causal)


@contextlib.contextmanager
def use(implementation: str = "auto", platform: str | None = None, budget_bytes: int | None = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS, mesh=None):
    """Run every network's attention (``compute``) through the seam while tracing in this block.

    ``implementation``: one of ``IMPLEMENTATIONS``; ``platform``: the platform the traced
    program will run on (default: JAX's default backend); ``budget_bytes``: see
    ``DEFAULT_BUDGET_BYTES`` (None: the platform's); ``block_tokens``: the Pallas
    kernel's block; ``mesh``: the mesh the traced program is partitioned over (an FSDP
    program: its Pallas kernels run per device). Yields a list that receives one ``Call``
    per attention call traced inside the block.

    The seam acts while JAX traces, so enter it inside the function that ``jit`` traces: around a ``jax.jit(f)`` call it has no effect when ``f``'s trace is
    already cached (the list then stays empty). The seam is per thread.
    """
    import jax

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    platform = platform_of(platform or jax.default_backend())
    budget = DEFAULT_BUDGET_BYTES[platform] if budget_bytes is None else budget_bytes
    seam = _Seam(implementation, platform, budget, block_tokens, [], mesh)
    outer = getattr(_ACTIVE, "seam", None)
    _ACTIVE.seam = seam
    try:
        yield seam.calls
    finally:
        _ACTIVE.seam = outer
