"""Write the PyTorch-safetensors twin of a Flax diffusers-format checkpoint (tests only).

The Flax -> PyTorch naming here is written independently of the libraries' PyTorch ->
Flax converters that ``pipeline.model.loading.weights`` uses, so a round trip checks one against the
other.
"""
import json
import os
import re
import shutil

import numpy as np
from flax.serialization import msgpack_restore
from flax.traverse_util import flatten_dict
from safetensors.numpy import save_file

# Flax names list entries "<list>_<i>"; PyTorch ModuleLists and Sequentials "<list>.<i>".
_LISTS = {"down_blocks", "up_blocks", "resnets", "attentions", "downsamplers", "upsamplers", "transformer_blocks",
          "net", "to_out"}
# The Flax VAE attention block is named query/key/value/proj_attn; PyTorch diffusers uses to_q/...
_VAE_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_PT_CLASSES = {"FlaxUNet2DConditionModel": "UNet2DConditionModel", "FlaxAutoencoderKL": "AutoencoderKL",
               "FlaxCLIPTextModel": "CLIPTextModel", "FlaxCLIPTextModelWithProjection": "CLIPTextModelWithProjection"}


def _pt_leaf(leaf, array):
    if leaf == "kernel" and array.ndim == 4:
        return "weight", np.ascontiguousarray(array.transpose(3, 2, 0, 1))  # HWIO -> OIHW
    if leaf == "kernel" and array.ndim == 2:
        return "weight", np.ascontiguousarray(array.T)  # (in, out) -> (out, in)
    if leaf in ("scale", "embedding"):
        return "weight", array
    return leaf, array


def diffusers_to_pt(flat):
    out = {}
    for path, array in flat.items():
        parts = []
        for part in path[:-1]:
            match = re.fullmatch(r"(.+)_(\d+)", part)
            if match and match.group(1) in _LISTS:
                parts.append(f"{match.group(1)}.{match.group(2)}")
            else:
                parts.append(_VAE_ATTENTION.get(part, part))
        leaf, array = _pt_leaf(path[-1], np.asarray(array))
        out[".".join(parts + [leaf])] = array
    return out


def transformers_to_pt(flat):
    out = {}
    for path, array in flat.items():
        leaf, array = _pt_leaf(path[-1], np.asarray(array))
        out[".".join(list(path[:-1]) + [leaf])] = array
    return out


def write_twin(src, dst):
    """Copy the checkpoint at ``src`` to ``dst`` with every network's weights as safetensors."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "model_index.json")) as f:
        index = json.load(f)
    for component in ("unet", "vae", "text_encoder", "text_encoder_2"):
        folder = os.path.join(dst, component)
        if not os.path.isdir(folder):
            continue
        diffusers_side = component in ("unet", "vae")
        flax_file = os.path.join(folder, "diffusion_flax_model.msgpack" if diffusers_side else "flax_model.msgpack")
        with open(flax_file, "rb") as f:
            flat = flatten_dict(msgpack_restore(f.read()))
        tensors = diffusers_to_pt(flat) if diffusers_side else transformers_to_pt(flat)
        name = "diffusion_pytorch_model.safetensors" if diffusers_side else "model.safetensors"
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        os.remove(flax_file)
        config_path = os.path.join(folder, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        if "_class_name" in config:
            config["_class_name"] = _PT_CLASSES[config["_class_name"]]
        if "architectures" in config:
            config["architectures"] = [_PT_CLASSES.get("Flax" + a.removeprefix("Flax"), a) for a in config["architectures"]]
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
        library, class_name = index[component]
        index[component] = [library, _PT_CLASSES[class_name]]
    index["_class_name"] = index["_class_name"].removeprefix("Flax")
    with open(os.path.join(dst, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
