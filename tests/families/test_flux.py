"""FLUX.1 through promptmill's family seam: loaded as any checkpoint is (``load``), planned
(its refusals), sampled by the generator, and run end to end on local hosts.

The networks and the sampling maths are checked against diffusers' PyTorch FluxPipeline
in test_flux_nets.py and test_flux_sampling.py; here the same fixture checkpoints go
through ``load.load`` (weights converted once and memory-mapped, the family's sampler)
and must give FluxPipeline's images within 2 levels; and a tiny [dev] run, its weights
sharded over pairs of devices, is byte-identical between 1x4 and 2x2 hosts x devices, and
``reproduce`` regenerates it on one pair.
"""
from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np
import pytest

from pipeline.collect import parts
from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.generate import sampler
from pipeline.io import storage
from pipeline.model import families, load as model_lib
from tests.conftest import TESTS, check_host_imports, run_cli

FIXTURES = os.path.join(TESTS, "fixtures", "flux")


@pytest.mark.parametrize("case", ["schnell-g0-s2-32x32", "dev-g3.5-s2-32x32"])
def test_a_flux_checkpoint_loaded_like_any_other_makes_diffusers_images(case, model_cache):
    fixture = dict(np.load(os.path.join(FIXTURES, f"{case}.npz")))
    variant, steps = str(fixture["variant"]), int(fixture["steps"])
    model = model_lib.load(os.path.join(FIXTURES, variant), dtype="fp32",
                           max_sequence_length=int(fixture["max_sequence_length"]))
    assert model.family is families.FLUX and model.latent_shape(32, 32) == tuple(fixture["latents"].shape[1:])
    assert model.sampler.choice == "flow_euler" and model.param_dtype == jax.numpy.float32
    again = model_lib.load(os.path.join(FIXTURES, variant), dtype="fp32",
                           max_sequence_length=int(fixture["max_sequence_length"]))
    leaf = again.params["transformer"]["transformer_blocks"]["attn"]["to_q"]["kernel"]
    while leaf is not None and not isinstance(leaf, np.memmap):
        leaf = leaf.base
    assert leaf is not None  # converted once, then memory-mapped
    rule = model.family.guidance_rule(model)
    assert rule == ("embedded" if variant == "dev" else "unused")
    denoise = jax.jit(sampler.make_denoise_fn(model, steps, guided=False, guidance_rule=rule))
    prompts = [str(p) for p in fixture["prompts"]]
    ids = model.family.tokenize(model, prompts)
    assert ids.shape == (2, 77 + int(fixture["max_sequence_length"]))
    params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), model.params)
    guidance = np.full((2,), fixture["guidance_scale"], np.float32)
    images = np.asarray(sampler.to_uint8(denoise(params, ids, np.zeros_like(ids), guidance, fixture["latents"])))
    assert np.abs(images.astype(int) - fixture["images_uint8"]).max() <= 2
    assert model.family.truncated(model, prompts) == [False, True]  # the long prompt is cut by both encoders


@pytest.mark.parametrize("change,message", [
    (dict(model="random-flux", width=520), "multiples of 16 pixels each way"),  # FLUX.1's VAE: 2 x 8
    (dict(scheduler="ddim"), "FLUX.1 samples with flow-matching Euler"),
    (dict(timestep_spacing="trailing"), "there is no spacing to set"),
    (dict(max_sequence_length=600), "--max-sequence-length must be a whole number of text tokens from 1 to 512"),
])
def test_a_flux_plan_refuses_what_flux_cannot_do(change, message, tmp_path, model_cache):
    from pipeline.plan.prepare import resolve_settings

    with pytest.raises(ValueError, match=message):
        resolve_settings(Settings(**{"model": "tiny-flux", "out": str(tmp_path), **change}))


def test_sd_refuses_a_t5_length_and_other_pipelines_are_refused_by_name(tmp_path, model_cache):
    from pipeline.plan.prepare import resolve_settings

    with pytest.raises(ValueError, match="--max-sequence-length 64: SD 1.x/2.x's CLIP text encoders take 77 tokens"):
        resolve_settings(Settings(model="tiny", out=str(tmp_path), max_sequence_length=64))
    with pytest.raises(ValueError, match="--scheduler flow_euler is the rectified-flow sampler of FLUX.1"):
        resolve_settings(Settings(model="tiny", out=str(tmp_path), scheduler="flow_euler"))
    for name in ("StableDiffusion3Pipeline", "QwenImagePipeline"):  # Flux2Pipeline: test_flux2_pipeline.py
        with pytest.raises(families.FamilyError, match=f"names the pipeline '{name}', which promptmill does not run"):
            families.detect({"_class_name": name}, "ckpt")
    assert families.detect({"_class_name": "FluxPipeline"}, "c") is families.FLUX
    assert families.detect({"_class_name": "FlaxStableDiffusionXLPipeline"}, "c") is families.SDXL
    assert families.detect({"text_encoder": ["transformers", "CLIPTextModel"]}, "c") is families.SD  # no class name


SIZES = ("32x32", "24x32", "32x24")  # square (the default), portrait, landscape


def _prompts(tmp_path):
    rows = [{"prompt": "a red fox in the snow", "id": "fox", "seed": 5},
            {"prompt": "a blue whale in the deep ocean", "id": "whale", "seed": 5,  # one seed, another prompt
             "width": 24, "height": 32},  # and a size of its own (SIZES)
            {"prompt": "a full moon", "id": "moon", "negative_prompt": "blurry", "guidance_scale": 5.0},
            {"prompt": "a painting of a city at night " * 4, "id": "city", "num_images": 2,  # > 16 T5 tokens
             "aspect_ratio": "16:9"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def flux_runs(tmp_path_factory, model_cache):
    """{hosts x devices: OUT} of one tiny [dev] run with its weights sharded over pairs of
    devices (``--fsdp 2``), on 2x2 and on 1x4 hosts x devices, in three sizes (``SIZES``:
    records ask for one by width/height, by aspect_ratio, or get the first). (The
    replicated program, --fsdp 1, is the one every SD run of the suite takes; FLUX.1's images
    at --fsdp 2 against --fsdp 1 are compared in test_fsdp.py.)"""
    folder = tmp_path_factory.mktemp("flux")
    prompts = _prompts(folder)
    outs = {}
    for hosts, devices in ((2, 2), (1, 4)):
        out = str(folder / f"flux-{hosts}x{devices}")
        result = run_cli(["run", "--prompts", prompts, "--out", out, "--model", "tiny-flux-dev", "--hosts",
                          str(hosts), "--devices-per-host", str(devices), "--steps", "2", "--max-sequence-length",
                          "16", "--per-device-batch", "1", "--batches-per-slice", "1", "--fsdp", "2",
                          "--sizes", ",".join(SIZES), "--no-progress"], model_cache)
        assert result.returncode == 0, result.stderr[-4000:]
        check_host_imports(result)
        outs[f"{hosts}x{devices}"] = out
    return outs


def _rows(out: str) -> dict:
    return {r["key"]: r for r in parts.dataset_rows(out)}


def test_a_sharded_flux_dev_run_is_the_same_on_1x4_and_2x2(flux_runs):
    outs = [flux_runs["2x2"], flux_runs["1x4"]]
    hashes = [{key: row["sha256"] for key, row in _rows(out).items()} for out in outs]
    assert len(hashes[0]) == 5 and hashes[0] == hashes[1]
    rows = _rows(outs[0])
    assert rows["fox_0000"]["sha256"] != rows["whale_0000"]["sha256"]  # one seed, two prompts: two images
    assert [rows[k]["guidance_scale"] for k in ("fox_0000", "moon_0000")] == [3.5, 5.0]  # [dev]'s default, its own
    assert rows["city_0001"]["prompt_truncated"] and not rows["fox_0000"]["prompt_truncated"]
    run = storage.read_json(naming.run_json(outs[0]))
    settings = run["settings"]
    assert (settings["guidance_rule"], settings["guided"], settings["scheduler"], settings["max_sequence_length"],
            settings["width"], settings["fsdp"]) == ("embedded", False, "flow_euler", 16, 32, 2)
    # each at its size: the portrait asked by width/height, the landscape by aspect ratio, the others the first
    assert {key: (r["width"], r["height"]) for key, r in rows.items()} == {
        "fox_0000": (32, 32), "moon_0000": (32, 32), "whale_0000": (24, 32), "city_0000": (32, 24),
        "city_0001": (32, 24)}
    assert [b["size"] for b in storage.read_json(naming.manifest(outs[0]))["buckets"]] == list(SIZES)
    assert run["sharding"]["transformer"]["placement"] == "sharded over 2 devices"
    assert run["sharding"]["vae"]["placement"] == "replicated"
    stats = storage.read_json(naming.dataset_file(outs[0], "stats.json"))
    assert stats["verified"] and stats["negative_prompts_unused"] == {"records": 1, "images": 1}
    assert stats["guidance_unused"] == {"records": 0, "images": 0}
    card = storage.read_text(naming.dataset_card(outs[0]))
    assert "embedded guidance: each image's guidance scale is an input of the denoiser" in card and "| text sequence length (tokens) | `16` |" in card
    assert "| FSDP (weights sharded over N devices) | `2` |" in card


def test_reproduce_regenerates_a_sharded_flux_image_bit_exactly_on_another_topology(flux_runs, model_cache):
    """``reproduce`` runs the run's own FSDP program on one group of 2 devices, at each
    image's own size: the program of a single-size run of the size."""
    out = flux_runs["1x4"]
    rows = _rows(out)
    result = run_cli(["reproduce", "whale_0000", "city_0001", "--out", out], model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["match"] for line in lines] == [True, True]
    assert hashlib.sha256(storage.read_bytes(naming.join(out, rows["whale_0000"]["path"]))).hexdigest() == \
        lines[0]["sha256"]
