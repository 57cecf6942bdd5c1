"""Component weights: Flax msgpack, or PyTorch safetensors converted without torch.

A diffusers-format checkpoint keeps each network's weights in its own folder, either
as Flax msgpack (``diffusion_flax_model.msgpack`` / ``flax_model.msgpack``) or as
PyTorch safetensors (``diffusion_pytorch_model.safetensors`` / ``model.safetensors``).
Safetensors are read as numpy arrays and mapped to Flax names and layouts with the
libraries' own renaming rules; the target tree comes from ``jax.eval_shape``, so no
random initialisation runs and torch is never imported. Flax msgpack is read the same
way, as numpy arrays checked against that tree. Weights stay on the host until the
generator puts them on its devices.
"""
from __future__ import annotations

import os
import types

import numpy as np

FLAX_FILES = {"diffusers": "diffusion_flax_model.msgpack", "transformers": "flax_model.msgpack"}
SAFETENSORS_FILES = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}
LIBRARY = {"unet": "diffusers", "vae": "diffusers", "text_encoder": "transformers", "text_encoder_2": "transformers"}


class WeightsError(ValueError):
    pass


def find(component_dir: str, component: str) -> tuple[str, str]:
    """("flax" | "safetensors", path) of a component's weights; Flax msgpack wins."""
    library = LIBRARY[component]
    for kind, name in (("flax", FLAX_FILES[library]), ("safetensors", SAFETENSORS_FILES[library])):
        path = os.path.join(component_dir, name)
        if os.path.isfile(path):
            return kind, path
    raise WeightsError(f"{component_dir}: no weights for '{component}' (expected {FLAX_FILES[library]} "
                       f"or {SAFETENSORS_FILES[library]})")


def _check_complete(where: str, shapes: dict, flat: dict) -> None:
    missing = sorted("/".join(k) for k in set(shapes) - set(flat))
    if missing:
        raise WeightsError(f"{where}: {len(missing)} weight(s) missing, e.g. {', '.join(missing[:5])}")
    for key, spec in shapes.items():
        if tuple(flat[key].shape) != tuple(spec.shape):
            raise WeightsError(f"{where}: weight {'/'.join(key)} has shape {tuple(flat[key].shape)}, "
                               f"the model expects {tuple(spec.shape)}")


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except Exception as e:  # a truncated or foreign file: name it
        raise WeightsError(f"{path}: not a readable safetensors file ({e})") from e


def _read_msgpack(path: str) -> dict:
    """The nested dict of numpy arrays in a Flax msgpack file (nothing goes to a device)."""
    from flax.serialization import msgpack_restore

    with open(path, "rb") as f:
        data = f.read()
    try:
        return msgpack_restore(data)
    except Exception as e:  # a truncated or foreign file: name it
        raise WeightsError(f"{path}: not a readable Flax msgpack file ({e})") from e


def params_from_msgpack(shapes_tree, path: str) -> dict:
    """Flax params from a Flax msgpack file, checked against the module's shapes: numpy
    arrays on the host, as stored, so the cast to the run's dtype happens on the host
    and each device receives its weights in one transfer."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    shapes = flatten_dict(shapes_tree)
    flat = {key: np.asarray(value) for key, value in flatten_dict(_read_msgpack(path)).items() if key in shapes}
    _check_complete(path, shapes, flat)
    return unflatten_dict(flat)


def _shapes(module):
    """The params' shapes of a diffusers Flax module, from its config alone: no
    initialiser runs, and the key is a shape too (a concrete one would be computed)."""
    import jax
    import jax.numpy as jnp

    return jax.eval_shape(module.init_weights, jax.ShapeDtypeStruct((2,), jnp.uint32))


def diffusers_params_from_safetensors(module, path: str) -> dict:
    """Flax params for a diffusers Flax module (UNet, VAE) from PyTorch safetensors."""
    from diffusers.models.modeling_flax_pytorch_utils import rename_key, rename_key_and_reshape_tensor
    from flax.traverse_util import flatten_dict, unflatten_dict

    shapes = flatten_dict(_shapes(module))
    flat = {}
    for pt_key, tensor in _read_safetensors(path).items():
        key, tensor = rename_key_and_reshape_tensor(tuple(rename_key(pt_key).split(".")), tensor, shapes)
        if key in shapes:  # anything else (buffers, unused heads) is not a weight of the Flax module
            flat[key] = np.asarray(tensor, dtype=np.float32)
    _check_complete(path, shapes, flat)
    return unflatten_dict(flat)


def transformers_params_from_safetensors(module, path: str) -> dict:
    """Flax params for a transformers Flax CLIP text model built with ``_do_init=False``."""
    from flax.traverse_util import flatten_dict, unflatten_dict
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    shapes = flatten_dict(module.params_shape_tree)
    # The converter only reads the target's key names and shapes and its prefix.
    target = types.SimpleNamespace(params=module.params_shape_tree, base_model_prefix=module.base_model_prefix)
    converted = flatten_dict(convert_pytorch_state_dict_to_flax(_read_safetensors(path), target))
    flat = {k: np.asarray(v, dtype=np.float32) for k, v in converted.items() if k in shapes}  # drops position_ids
    _check_complete(path, shapes, flat)
    return unflatten_dict(flat)


def load_diffusers(cls, directory: str, component: str, dtype, weights_file: str | None = None,
                   abstract: bool = False):
    """(module, params) of a UNet or VAE folder, whatever its weight format; with
    ``weights_file`` (PyTorch safetensors), the folder's config with that file's weights.
    ``abstract``: params as float32 ``jax.ShapeDtypeStruct``s, from the config alone (no
    weight is read or initialised)."""
    component_dir = os.path.join(directory, component)
    module = cls.from_config(cls.load_config(component_dir), dtype=dtype)
    if abstract:
        return module, _shapes(module)
    kind, path = ("safetensors", weights_file) if weights_file else find(component_dir, component)
    if kind == "flax":
        return module, params_from_msgpack(_shapes(module), path)
    return module, diffusers_params_from_safetensors(module, path)


def load_transformers(cls, directory: str, component: str, dtype, abstract: bool = False):
    """(module, params) of a CLIP text encoder folder, whatever its weight format;
    ``abstract``: see ``load_diffusers``."""
    from transformers import CLIPTextConfig

    component_dir = os.path.join(directory, component)
    if abstract:
        module = cls(CLIPTextConfig.from_pretrained(component_dir), dtype=dtype, _do_init=False)
        return module, module.params_shape_tree
    kind, path = find(component_dir, component)
    # _do_init=False: no random initialisation of weights the file replaces anyway (the
    # eager init took most of a small model's load time)
    module = cls(CLIPTextConfig.from_pretrained(component_dir), dtype=dtype, _do_init=False)
    if kind == "flax":
        return module, params_from_msgpack(module.params_shape_tree, path)
    return module, transformers_params_from_safetensors(module, path)


def param_shapes(directory: str, component: str) -> dict:
    """{flat parameter path: shape} of a component's Flax network, from its config alone
    (``abstract``: no weights are read and no initialiser runs)."""
    import jax.numpy as jnp
    from flax.traverse_util import flatten_dict

    if LIBRARY[component] == "diffusers":
        from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel

        cls = FlaxUNet2DConditionModel if component == "unet" else FlaxAutoencoderKL
        _, tree = load_diffusers(cls, directory, component, jnp.float32, abstract=True)
    else:
        from transformers import FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection

        cls = FlaxCLIPTextModelWithProjection if component == "text_encoder_2" else FlaxCLIPTextModel
        _, tree = load_transformers(cls, directory, component, jnp.float32, abstract=True)
    return {path: tuple(leaf.shape) for path, leaf in flatten_dict(tree).items()}
