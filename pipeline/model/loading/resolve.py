"""Where a checkpoint comes from: the folder behind ``--model``.

A checkpoint is a diffusers-format directory (``model_index.json``, ``tokenizer/``,
``text_encoder/``, ``unet/``, ``vae/``, ``scheduler/``; SDXL adds ``tokenizer_2/`` and
``text_encoder_2/``): a built-in random model (``pipeline.model.load.resolve`` takes
those names first), a local folder, a ``gs://`` prefix copied once per machine into the
local cache (``pipeline.model.loading.fetch``), or a Hugging Face id, fetched here
through the hub's own cache. What it is, its fingerprint, is
``pipeline.model.loading.identity``'s.
"""
from __future__ import annotations

import os
import re

from pipeline.model.loading.checkpoint import ModelError
from pipeline.model.loading.fetch import fetch_remote

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.txt", "*.msgpack", "*.safetensors"]


def resolve(name: str, weights: bool = True) -> str:
    """The local diffusers-format directory of a checkpoint that is not built in
    (``pipeline.model.load.resolve`` takes the built-in names first).

    A local folder, a ``gs://`` prefix (copied once into the cache, keyed by the
    objects' checksums), or a Hugging Face id (fetched through the hub's own cache,
    where the network allows). ``weights=False``: for a ``gs://`` prefix, a folder of its
    configs alone (``fetch_remote``), enough to describe the model; every other source
    is whole either way.
    """
    from pipeline.io import storage

    if storage.is_gcs(name):
        return fetch_remote(name, weights)
    if os.path.isdir(name):
        return name
    if _HUB_ID.fullmatch(name) and not os.path.exists(name):
        return _fetch_hub(name)
    raise ModelError(f"model {name!r} is not a directory (give a diffusers-format folder, a gs:// prefix or a "
                     f"Hugging Face id)")


def _fetch_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
    except Exception as e:  # offline, unknown id, gated repo: say which and why
        raise ModelError(f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
                         "download it elsewhere and pass the folder or a gs:// copy") from e
