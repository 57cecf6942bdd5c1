"""The built-in random FLUX.1 models (``pipeline.model.families.flux.presets``) are laid out as diffusers'
own ``FluxPipeline.save_pretrained`` lays out a checkpoint, and ``random-flux`` has FLUX.1's
real sizes.

``tests/fixtures/flux/dev`` was written by diffusers' PyTorch ``save_pretrained`` from the
``tiny-flux-dev`` preset's configs and tokenizers (``make_flux_fixtures.sh``, which also loads
promptmill's own ``tiny-flux`` builds into diffusers' PyTorch pipeline, strictly): promptmill's
build of the same preset, written without torch through ``to_torch``, has the same files, the
same configs, the same tokenizers and the same weight names and shapes, stored in bf16.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pipeline.model.sampling import flow
from pipeline.model.families.flux import presets as tiny_flux
from pipeline.model.loading import weights
from pipeline.model.families.flux import transformer as flux
from pipeline.model.layers import vae
from pipeline.model.layers.text import t5
from tests.conftest import ROOT, TESTS

FIXTURES = os.path.join(TESTS, "fixtures", "flux")
VERSIONS = ("_diffusers_version", "transformers_version", "dtype")  # who wrote it, and the stored dtype


def files(directory) -> set[str]:
    return {os.path.relpath(os.path.join(root, f), directory) for root, _, names in os.walk(directory)
            for f in names}


def config(directory, path) -> dict:
    with open(os.path.join(directory, path)) as f:
        return {k: v for k, v in json.load(f).items() if k not in VERSIONS}


def metadata(path) -> dict:
    """The ``__metadata__`` of a safetensors file's header."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length)).get("__metadata__", {})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny-flux-dev") / "model")
    tiny_flux.build(directory, "tiny-flux-dev")
    return directory


def test_tiny_flux_dev_is_laid_out_as_diffusers_saves_it(built):
    reference = os.path.join(FIXTURES, "dev")
    assert files(built) == files(reference)
    for path in ("model_index.json", "scheduler/scheduler_config.json", "transformer/config.json", "vae/config.json",
                 "text_encoder/config.json", "text_encoder_2/config.json", "tokenizer/tokenizer_config.json",
                 "tokenizer/special_tokens_map.json", "tokenizer/vocab.json", "tokenizer_2/tokenizer_config.json",
                 "tokenizer_2/special_tokens_map.json", "tokenizer_2/tokenizer.json"):
        assert config(built, path) == config(reference, path), path
    for component, name in (("text_encoder", "model.safetensors"), ("text_encoder_2", "model.safetensors"),
                            ("transformer", "diffusion_pytorch_model.safetensors"),
                            ("vae", "diffusion_pytorch_model.safetensors")):
        ours = weights.read_mapped(os.path.join(built, component, name))
        theirs = weights.read_mapped(os.path.join(reference, component, name))
        assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}, component
        assert {v.dtype.name for v in ours.values()} == {"bfloat16"}
        assert all(np.isfinite(v.astype(np.float32)).all() for v in ours.values())
        assert metadata(os.path.join(built, component, name)) == metadata(os.path.join(reference, component, name))


def test_the_builds_are_deterministic(built, tmp_path):
    again = str(tmp_path / "again")
    tiny_flux.build(again, "tiny-flux-dev")
    for path in sorted(files(built)):
        with open(os.path.join(built, path), "rb") as a, open(os.path.join(again, path), "rb") as b:
            assert a.read() == b.read(), path


def test_tiny_flux_is_schnell_and_the_configs_are_honoured(tmp_path):
    directory = str(tmp_path / "tiny-flux")
    tiny_flux.build(directory, "tiny-flux", weights=False)
    assert not any(path.endswith(".safetensors") for path in files(directory))
    transformer = flux.FluxConfig.from_dict(config(directory, "transformer/config.json"))
    assert not transformer.guidance_embeds and (transformer.num_layers, transformer.num_single_layers) == (2, 2)
    scheduler = config(directory, "scheduler/scheduler_config.json")
    assert flow.unsupported(scheduler) == [] and not scheduler["use_dynamic_shifting"]
    dev = config(os.path.join(FIXTURES, "dev"), "scheduler/scheduler_config.json")
    assert dev["use_dynamic_shifting"] and dev["shift"] == 3.0


def test_random_flux_has_flux1s_real_sizes(tmp_path):
    """``random-flux`` written configs-only: FLUX.1 [schnell]'s 11.9B-parameter transformer
    (19 double and 38 single blocks of 24 x 128), T5-v1.1-XXL's 4.76B-parameter encoder, the
    16-channel VAE with 8x downsampling; ``random-flux-dev`` adds [dev]'s guidance embedder."""
    directory = str(tmp_path / "random-flux")
    tiny_flux.build(directory, "random-flux", weights=False)
    assert not any(path.endswith(".safetensors") for path in files(directory))

    def count(shapes):
        return sum(int(np.prod(shape)) for shape in shapes.values())

    transformer = flux.FluxConfig.from_dict(config(directory, "transformer/config.json"))
    assert count(flux.NETWORK.param_shapes(transformer)) == 11_891_178_560
    dev = flux.FluxConfig.from_dict(tiny_flux.transformer_config("random-flux-dev"))
    assert count(flux.NETWORK.param_shapes(dev)) == 11_901_408_320
    encoder = t5.T5Config.from_dict(json.load(open(os.path.join(directory, "text_encoder_2", "config.json"))))
    assert count(t5.NETWORK.param_shapes(encoder)) == 4_762_310_656
    decoder = vae.VaeConfig.from_dict(config(directory, "vae/config.json"))
    assert (decoder.scale_factor, decoder.latent_channels, decoder.shift_factor) == (8, 16, 0.1159)
    assert flow.unsupported(config(directory, "scheduler/scheduler_config.json")) == []


def test_the_t5_tokenizer(tmp_path):
    from pipeline.model.loading import tokenizer as tokenizer_lib

    tiny_flux.write_tokenizers(str(tmp_path))
    tokenizer = tokenizer_lib.from_json(str(tmp_path / "tokenizer_2"), 512)
    backend = tokenizer.backend
    assert [backend.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2] and tokenizer.pad_id == 0
    ids = tokenizer.ids(["a red fox, 42"], 8)[0]
    assert [backend.id_to_token(i) for i in ids] == ["\u2581a", "\u2581red", "\u2581fox", ",", "\u2581", "4", "2", "</s>"]
    assert 2 not in tokenizer.ids(["Any Plain TEXT (ascii), 0-9!"], 64)[0]
    assert backend.get_vocab_size() <= json.load(open(os.path.join(FIXTURES, "dev", "text_encoder_2",
                                                                   "config.json")))["vocab_size"]


def test_the_presets_import_no_jax():
    """The torch-only fixture script imports the presets: they must not need jax."""
    code = "import sys; from pipeline.model.families.flux import presets; assert presets.PRESETS; " \
           "assert 'jax' not in sys.modules and 'flax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
