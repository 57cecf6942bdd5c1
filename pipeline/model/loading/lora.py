"""LoRA adapters, merged into a model's weights once, at load: W' = W + scale·(alpha/rank)·up·down.

A LoRA file holds, for some Dense layers and convolutions of the UNet and the text
encoders, a low-rank update: ``down`` (rank x in [x kh x kw]) and ``up`` (out x rank
[x 1 x 1]), in PyTorch's layout, with an ``alpha`` that scales it by alpha/rank. Two
formats are read:

- diffusers/PEFT: ``unet.``, ``text_encoder.``, ``text_encoder_2.`` + the layer's module
  path + ``.lora_A.weight``/``.lora_B.weight`` (older files: ``.lora.down.weight``/
  ``.lora.up.weight``, ``.lora_linear_layer.``, ``.processor.``, ``to_q_lora``: read by
  ``_peft_name``), alpha from the adapter config diffusers keeps in the safetensors
  header (``lora_adapter_metadata``), else from ``.alpha`` keys, else the rank;
- kohya: ``lora_unet_``, ``lora_te_``/``lora_te1_``, ``lora_te2_`` + the module path with
  '_' for '.' + ``.lora_down.weight``/``.lora_up.weight``/``.alpha``.

Both name a layer by its module path, and promptmill's networks keep PyTorch's module
names (``down_blocks/0/attentions/0/.../attn1/to_q/kernel`` for
``down_blocks.0.attentions.0....attn1.to_q``; a scanned stack's block by its index,
``kernels``). So a layer is found by its path joined with '_' (kohya's own spelling) in
the model's own parameter tree, for every format and architecture, with no table of
names to keep up to date; two layers whose joined names collide would be refused, not
guessed between.

The merge runs on the host in float32, before the cast to the run's dtype and the
transfer to devices: the compiled program is the one without adapters (only parameter
values change), so an adapter costs nothing per step, and changing it recompiles nothing.
Every key must find its layer: an unmatched key, a shape that does not fit, or an
adapter made for another family is a ``LoraError`` that names it.
"""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

COMPONENTS = ("unet", "text_encoder", "text_encoder_2", "transformer")
DIFFUSERS, KOHYA = "diffusers/PEFT", "kohya"
_KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder",
                   "lora_te2_": "text_encoder_2"}
_KOHYA_SUFFIXES = {".lora_down.weight": "down", ".lora_up.weight": "up", ".alpha": "alpha"}
_PEFT_SUFFIXES = {".lora_A.weight": "down", ".lora_B.weight": "up", ".alpha": "alpha",
                  ".lora.down.weight": "down", ".lora.up.weight": "up"}  # the latter: older text encoder files
# the adapter configs diffusers' save_lora_weights writes into the safetensors header
_METADATA_KEY = "lora_adapter_metadata"
_SHOWN = 5  # unmatched keys named in an error
# FLUX.1 LoRAs that name BFL's original blocks (img_attn_qkv, ...): kohya's and the original format
_FLUX_NATIVE = ("lora_unet_double_blocks_", "lora_unet_single_blocks_", "diffusion_model.double_blocks.",
                "diffusion_model.single_blocks.", "lora_transformer_double_blocks_", "lora_transformer_single_blocks_")


class LoraError(ValueError):
    """A LoRA file that cannot be merged into the model; the message names the file and why."""


@dataclasses.dataclass(frozen=True)
class Update:
    """One layer's low-rank update, as the file holds it."""
    component: str  # "unet" | "text_encoder" | "text_encoder_2"
    layer: str  # the layer's module path, '_'-joined (kohya's spelling)
    down: str  # the file's key of the down (A) matrix, as the file spells it
    up: str  # ... of the up (B) matrix
    alpha: float | None  # None: the rank (alpha / rank = 1)
    rslora: bool = False  # PEFT's rank-stabilised scaling: alpha / sqrt(rank)


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A LoRA file read for merging: its format, updates, and every tensor's shape."""
    path: str
    format: str
    updates: tuple[Update, ...]
    shapes: dict  # key -> shape, from the header

    def factor(self, update: Update, scale: float) -> np.float32:
        """scale · alpha / rank (alpha / sqrt(rank) for rsLoRA), as the merge multiplies."""
        rank = self.shapes[update.down][0]
        alpha = rank if update.alpha is None else update.alpha
        return np.float32(scale * alpha / (np.sqrt(rank) if update.rslora else rank))


@dataclasses.dataclass(frozen=True)
class Match:
    """An update and the Flax kernel it changes."""
    update: Update
    path: tuple[str, ...]  # the kernel's path in the component's parameter tree
    shape: tuple[int, ...]  # the kernel's shape: (in, out), or (kh, kw, in, out); one block's, when stacked
    index: int | None = None  # the block, in a stacked (scanned) kernel of all blocks


def read(path: str) -> Adapter:
    """The adapter in the safetensors file ``path``, from its header (and its alpha scalars);
    LoraError for an unreadable file, an unknown format or a variant that is not plain LoRA."""
    from safetensors import safe_open

    try:
        with safe_open(path, "np") as f:
            header = f.metadata() or {}
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
            alphas = {key: float(np.asarray(f.get_tensor(key)).reshape(())) for key in shapes
                      if key.endswith(".alpha")}
    except FileNotFoundError:
        raise LoraError(f"--lora {path}: no such file") from None
    except Exception as e:  # a truncated or foreign file
        raise LoraError(f"--lora {path}: not a readable safetensors file ({e})") from None
    keys = list(shapes)
    flux_native = [key for key in keys if key.startswith(_FLUX_NATIVE)]
    if flux_native:
        raise LoraError(f"--lora {path}: a FLUX.1 LoRA in kohya's or Black Forest Labs' own format (keys such as "
                        f"{flux_native[0]}, naming the original double/single blocks), which promptmill does not "
                        f"read yet; use one in diffusers' format (transformer.transformer_blocks.N..., as diffusers' "
                        f"save_lora_weights writes it)")
    if any(key.startswith(tuple(_KOHYA_PREFIXES)) for key in keys):
        updates = _kohya_updates(path, keys, alphas)
        return Adapter(path, KOHYA, updates, shapes)
    if any(key.startswith(f"{component}.") for key in keys for component in COMPONENTS):
        renamed = _diffusers_names(keys)
        _refuse_unknown(path, DIFFUSERS, [key for key in keys if key not in renamed])  # no component's prefix
        updates = _diffusers_updates(path, renamed, alphas, _adapter_configs(path, header))
        return Adapter(path, DIFFUSERS, updates, shapes)
    raise LoraError(f"--lora {path}: not a LoRA in a known format (diffusers/PEFT keys start with unet., "
                    f"text_encoder., text_encoder_2.; kohya keys with lora_unet_, lora_te_, lora_te1_, lora_te2_); "
                    f"its first keys: {', '.join(sorted(keys)[:_SHOWN]) or 'none'}")


def _kohya_updates(path: str, keys: list[str], alphas: dict) -> tuple[Update, ...]:
    parts, unknown = {}, []
    for key in keys:
        prefix = next((p for p in _KOHYA_PREFIXES if key.startswith(p)), None)
        suffix = next((s for s in _KOHYA_SUFFIXES if key.endswith(s)), None)
        if prefix is None or suffix is None:  # LoHa, LoKr, DoRA, full diffs: not a plain LoRA
            unknown.append(key)
            continue
        name = (_KOHYA_PREFIXES[prefix], key[len(prefix):-len(suffix)])
        parts.setdefault(name, {})[_KOHYA_SUFFIXES[suffix]] = key
    _refuse_unknown(path, KOHYA, unknown)
    return _pair(path, KOHYA, parts, lambda name, keys_: alphas.get(keys_.get("alpha")) if "alpha" in keys_ else None)


# the older diffusers names of attention projections' adapters (its attention processors'
# ``to_q_lora``...) -> the layer they adapt, in the UNet and in the text encoders
_OLD_PROJECTIONS = {"to_q": ("to_q", "q_proj"), "to_k": ("to_k", "k_proj"), "to_v": ("to_v", "v_proj"),
                    "to_out": ("to_out.0", "out_proj")}
_OLD_PROJECTION = re.compile(r"\.(to_q|to_k|to_v|to_out)_lora\.(down|up|alpha)\b")


def _peft_name(key: str) -> str:
    """The PEFT spelling of a diffusers LoRA key: its older forms (an attention processor's
    ``.processor.`` and ``to_q_lora.down``, a text encoder's ``lora_linear_layer``) name the
    layer they adapt and ``lora.down``/``lora.up``, which ``_PEFT_SUFFIXES`` reads."""
    component, _, rest = key.partition(".")
    rest = rest.replace(".processor.", ".").replace(".lora_linear_layer.", ".lora.")
    found = _OLD_PROJECTION.search(rest)
    if found:
        unet_layer, text_layer = _OLD_PROJECTIONS[found.group(1)]
        layer = unet_layer if component == "unet" else text_layer
        half = "alpha" if found.group(2) == "alpha" else f"lora.{found.group(2)}"
        rest = f"{rest[:found.start()]}.{layer}.{half}{rest[found.end():]}"
    return f"{component}.{rest}"


def _diffusers_names(keys: list[str]) -> dict[str, str]:
    """{key: its PEFT name} of the keys under a component's prefix (``_peft_name``)."""
    return {key: _peft_name(key) for key in keys if key.split(".", 1)[0] in COMPONENTS}


def _adapter_configs(path: str, header: dict) -> dict:
    """{component: the PEFT LoraConfig fields diffusers saved for it} from the header."""
    raw = header.get(_METADATA_KEY)
    if not raw:
        return {}
    try:
        packed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LoraError(f"--lora {path}: its {_METADATA_KEY} header is not JSON ({e})") from None
    configs = {}
    for key, value in packed.items():
        component, _, field = key.partition(".")
        configs.setdefault(component, {})[field] = value
    for component, config in configs.items():
        if config.get("use_dora"):
            raise LoraError(f"--lora {path}: its {component} adapter is DoRA (use_dora), which promptmill does not "
                            f"merge; use a plain LoRA")
    return configs


def _diffusers_updates(path: str, renamed: dict, alphas: dict, configs: dict) -> tuple[Update, ...]:
    parts, unknown, alpha_of = {}, [], {}
    for key, name in renamed.items():
        component = name.split(".", 1)[0]
        suffix = next((s for s in _PEFT_SUFFIXES if name.endswith(s)), None)
        if suffix is None:  # lora_magnitude_vector (DoRA), biases of lora_B, anything else
            unknown.append(key)
            continue
        module = name[len(component) + 1:-len(suffix)]
        parts.setdefault((component, module), {})[_PEFT_SUFFIXES[suffix]] = key
        if suffix == ".alpha":
            alpha_of[component, module] = alphas[key]
    _refuse_unknown(path, DIFFUSERS, unknown)

    def alpha(name, _keys):
        component, module = name
        config = configs.get(component)
        if config is None:  # no adapter config saved: the .alpha keys, else the rank
            return alpha_of.get(name)
        for pattern, value in (config.get("alpha_pattern") or {}).items():
            if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):  # PEFT's rule: a pattern matches a path's tail
                return float(value)
        return float(config["lora_alpha"]) if "lora_alpha" in config else None

    updates = _pair(path, DIFFUSERS, parts, alpha)
    return tuple(dataclasses.replace(u, layer=u.layer.replace(".", "_"),
                                     rslora=bool(configs.get(u.component, {}).get("use_rslora")))
                 for u in updates)


def _pair(path: str, format_: str, parts: dict, alpha) -> tuple[Update, ...]:
    """One Update per layer that has both a down and an up; LoraError naming a half pair."""
    updates, half = [], []
    for name, keys in sorted(parts.items()):
        if "down" not in keys or "up" not in keys:
            half += sorted(keys.values())
            continue
        updates.append(Update(component=name[0], layer=name[1], down=keys["down"], up=keys["up"],
                              alpha=alpha(name, keys)))
    if half:
        raise LoraError(f"--lora {path} ({format_} format): {len(half)} key(s) without their down/up partner, "
                        f"e.g. {', '.join(half[:_SHOWN])}")
    return tuple(updates)


def _refuse_unknown(path: str, format_: str, keys: list[str]) -> None:
    if keys:
        raise LoraError(f"--lora {path} ({format_} format): {len(keys)} key(s) are not plain LoRA weights "
                        f"(down/up/alpha) and match no layer, e.g. {', '.join(sorted(keys)[:_SHOWN])}")


# ---------------------------------------------------------------- matching

def kernels(shapes: dict, torch_names: dict | None = None) -> dict[str, dict[str, tuple]]:
    """{component: {'_'-joined layer name: (kernel path, kernel shape, block index)}} of a
    model's Dense and convolution kernels, from {component: flat {path: shape}}. A
    component of promptmill's own networks (``torch_names``: {component:
    ``convert.TorchNames``}) names its layers by PyTorch's names (``convert.torch_name``),
    one per block of a stacked kernel (block index, and one block's shape). A joined name
    that two layers share maps to None (a match on it is refused)."""
    from pipeline.model.loading import convert

    torch_names = torch_names or {}
    index = {}
    for component, flat in shapes.items():
        own = index.setdefault(component, {})
        names = torch_names.get(component)
        for path, shape in flat.items():
            if path[-1] != "kernel":
                continue
            path, shape = tuple(path), tuple(shape)
            if names is None or convert.stack_of(path, names) is None:
                entries = [("_".join(path[:-1]), shape, None)]
            else:
                entries = [(convert.torch_name(path, names, i).removesuffix(".weight").replace(".", "_"), shape[1:], i)
                           for i in range(shape[0])]
            for name, one, block in entries:
                own[name] = None if name in own else (path, one, block)
    return index


def match(adapter: Adapter, shapes: dict, torch_names: dict | None = None) -> list[Match]:
    """Every update of ``adapter`` with the kernel it changes, for a model whose components'
    flat parameter shapes are ``shapes`` ({component: {path: shape}}; ``torch_names``: see
    ``kernels``); LoraError for an adapter of another family, a key that matches no
    layer, or a shape that does not fit."""
    _check_family(adapter, shapes)
    index = kernels(shapes, torch_names)
    matches, unmatched = [], []
    for update in adapter.updates:
        found = index.get(update.component, {}).get(update.layer)
        if found is None:
            unmatched += [update.down, update.up]
            continue
        matches.append(Match(update, *found))
    if unmatched:
        hint = ""
        if any(re.match(r"lora_unet_(input_blocks|middle_block|output_blocks)_", key) for key in unmatched):
            hint = ("; they name the UNet's layers by the original Stability blocks (input_blocks, middle_block, "
                    "output_blocks), which promptmill does not read: convert the file to diffusers' layer names")
        raise LoraError(f"--lora {adapter.path} ({adapter.format} format): {len(unmatched)} key(s) match no layer "
                        f"of the model, e.g. {', '.join(unmatched[:_SHOWN])}{hint}")
    for found in matches:
        _check_shapes(adapter, found)
    return matches


def _check_family(adapter: Adapter, shapes: dict) -> None:
    """LoraError when the adapter was made for another kind of model than ``shapes``': it
    adapts a component the model lacks (a UNet, a transformer, a second text encoder), or
    a UNet whose cross-attention takes text features of another width."""
    components = sorted({u.component for u in adapter.updates})
    missing = [c for c in components if c not in shapes]
    if missing:
        raise LoraError(f"--lora {adapter.path}: made for another model family: it adapts {', '.join(missing)}, "
                        f"which the model does not have (it has {', '.join(sorted(shapes))}); use a LoRA made for "
                        f"the model's family")
    width = _model_context_width(shapes)
    for update in adapter.updates:
        if update.component == "unet" and update.layer.endswith(("attn2_to_k", "attn2_to_v")):
            theirs = adapter.shapes[update.down][1]
            if width is not None and theirs != width:
                raise LoraError(f"--lora {adapter.path}: made for another model family: its UNet's cross-attention "
                                f"takes {theirs}-wide text features, the model's {width}-wide; use a LoRA made for "
                                f"the model's family")
            return


def _model_context_width(shapes: dict) -> int | None:
    for path, shape in shapes.get("unet", {}).items():
        if path[-3:] == ("attn2", "to_k", "kernel"):
            return int(shape[0])
    return None


def _check_shapes(adapter: Adapter, found: Match) -> None:
    down, up = adapter.shapes[found.update.down], adapter.shapes[found.update.up]
    kernel = found.shape
    out, fan_in = kernel[-1], kernel[-2]
    window = tuple(kernel[:2]) if len(kernel) == 4 else (1, 1)
    ok = (len(down) in (2, 4) and len(up) in (2, 4) and down[0] == up[1] and down[1] == fan_in and up[0] == out
          and (tuple(down[2:]) or (1, 1)) == window and tuple(up[2:]) in ((), (1, 1)))
    if not ok:
        where = "/".join((found.update.component,) + found.path)
        raise LoraError(f"--lora {adapter.path} ({adapter.format} format): {found.update.down} {down} and "
                        f"{found.update.up} {up} do not fit {where} {kernel} (an adapter for another architecture)")


# ---------------------------------------------------------------- merging

def delta(down: np.ndarray, up: np.ndarray, kernel_shape: tuple[int, ...]) -> np.ndarray:
    """up·down in float32, laid out as the Flax kernel: (in, out) for a Dense layer, the
    transpose of PyTorch's (out, in); (kh, kw, in, out) for a convolution, from PyTorch's
    (out, in, kh, kw) (the down is the kh x kw convolution, the up a 1 x 1)."""
    up = np.asarray(up, np.float32).reshape(up.shape[0], up.shape[1])
    down = np.asarray(down, np.float32)
    product = up @ down.reshape(down.shape[0], -1)  # (out, in·kh·kw)
    if len(kernel_shape) == 2:
        return product.T
    kh, kw, fan_in, out = kernel_shape
    return product.reshape(out, fan_in, kh, kw).transpose(2, 3, 1, 0)


def merge(params: dict, loras: list[tuple[str, float]], torch_names: dict | None = None, shapes: dict | None = None,
          dtype=None) -> dict:
    """``params`` ({component: tree}) with each (local file, scale) of ``loras`` merged in
    order: kernel + float32(scale·alpha/rank)·(up·down), in float32 numpy on the host, then
    in ``dtype`` (None: the kernel's own; a run's dtype, when it is not the stored one). A
    changed kernel is copied once (the one copy a merge makes), and merged one block at a
    time (a stacked kernel, ``torch_names``: see ``kernels``): float32 is only ever one block's
    worth, so a bf16 model is never held in float32. ``shapes`` ({component: flat shapes}):
    the whole networks a LoRA names layers of, when ``params`` hold fewer (a text encoder
    whose last layer a run never computes): an update of a layer ``params`` lack changes
    nothing the run computes and is not merged. The parameters given are never modified."""
    import contextlib

    from flax.traverse_util import flatten_dict, unflatten_dict
    from safetensors import safe_open

    if not loras:
        return params
    flat = {name: flatten_dict(tree) for name, tree in params.items() if name in COMPONENTS}
    held = {name: {path: tuple(np.shape(leaf)) for path, leaf in tree.items()} for name, tree in flat.items()}
    shapes = held if shapes is None else {name: shapes[name] for name in held}
    # (component, kernel path) -> {block: [(file, factor, match)]}: a kernel's updates, in the files' order
    steps: dict = {}
    for path, scale in loras:
        adapter = read(path)
        for found in match(adapter, shapes, torch_names):
            have = held[found.update.component].get(found.path)
            if have is None or (found.index is not None and found.index >= have[0]):
                continue  # a layer the run never computes
            blocks = steps.setdefault((found.update.component, found.path), {})
            blocks.setdefault(found.index, []).append((path, adapter.factor(found.update, scale), found))
    changed = {}
    with contextlib.ExitStack() as files:
        tensors = {path: files.enter_context(safe_open(path, "np")) for path in {path for path, _ in loras}}
        for key, blocks in steps.items():
            component, kernel_path = key
            stored = flat[component][kernel_path]
            kernel = np.array(stored, dtype=dtype)  # writable: in the stored dtype, or dtype
            for index, updates in blocks.items():
                where = ... if index is None else index
                value = np.asarray(stored[where]).astype(np.float32)  # from the stored values
                for path, factor, found in updates:
                    down = tensors[path].get_tensor(found.update.down)
                    up = tensors[path].get_tensor(found.update.up)
                    value += factor * delta(down, up, found.shape)
                kernel[where] = value  # in the kernel's dtype
            changed[key] = kernel
    merged = dict(params)
    for component in {component for component, _ in changed}:
        tree = dict(flat[component])
        tree.update({path: value for (name, path), value in changed.items() if name == component})
        merged[component] = unflatten_dict(tree)
    return merged

