"""The one settings object: run.json round-trips into a typed Run, old run.json files
still read (and keep their fingerprint), and an unknown setting is an error."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.core import naming
from pipeline.core.settings import Lora, Run, Settings, check_size, fingerprint, parse_lora
from pipeline.io import runs, storage

SETTINGS = Settings(prompts="gs://b/p/*.jsonl", out="gs://b/out", model="/models/sd", width=512, height=768,
                    steps=30, scheduler="euler", guidance_scale=5.0, seed=99, per_device_batch=4,
                    batches_per_slice=3, devices_per_host=8, dtype="bf16", formats=("files", "zarr"),
                    image_format="webp", quality=80, save_latents=True, prompt_field="text", dedupe=True,
                    loras=("gs://b/loras/style.safetensors@0.8", "/loras/lcm@1.0"))


def run_of(settings: Settings) -> Run:
    loras = tuple(Lora(path, scale, "a" * 64) for path, scale in map(parse_lora, settings.loras))
    return Run.create(settings, "f" * 64, created_at="2026-01-02T03:04:05+00:00",
                      versions={"promptmill": "0.1.0", "jax": "0.10.2"}, loras=loras)


def as_stored(run: Run) -> dict:
    return json.loads(json.dumps(run.to_dict()))  # what run.json holds: tuples are lists


def test_every_setting_round_trips_through_run_json():
    run = run_of(SETTINGS)
    assert Run.from_dict(as_stored(run)) == run
    assert Run.from_dict(as_stored(run)).settings.formats == ("files", "zarr")
    default = run_of(Settings())
    assert Run.from_dict(as_stored(default)) == default
    assert {f.name for f in dataclasses.fields(Settings)} == set(as_stored(run)["settings"])


def test_run_json_has_the_documented_keys(tmp_path):
    out = str(tmp_path)
    runs.write(out, run_of(SETTINGS))
    stored = storage.read_json(naming.run_json(out))
    assert set(stored) == {"settings", "model_fingerprint", "scheduler", "settings_fingerprint", "versions",
                           "created_at", "loras", "scorers", "layout", "settings_version"}
    assert stored["scheduler"] == "euler" and stored["versions"] == {"jax": "0.10.2", "promptmill": "0.1.0"}
    assert stored["loras"] == [{"path": "gs://b/loras/style.safetensors", "scale": 0.8, "sha256": "a" * 64},
                               {"path": "/loras/lcm", "scale": 1.0, "sha256": "a" * 64}]
    assert runs.read(out) == run_of(SETTINGS)


def test_a_run_json_without_a_settings_fingerprint_gets_it_computed():
    stored = as_stored(run_of(SETTINGS))
    expected = stored.pop("settings_fingerprint")
    assert Run.from_dict(stored).settings_fingerprint == expected


def test_an_unknown_setting_is_an_error_that_names_it(tmp_path):
    stored = as_stored(run_of(SETTINGS))
    stored["settings"]["guidence_scale"] = 0
    with pytest.raises(ValueError, match="unknown run setting.*guidence_scale"):
        Run.from_dict(stored)
    out = str(tmp_path)
    storage.write_json(naming.run_json(out), stored)
    with pytest.raises(runs.RunNotPlanned, match=r"run.json is not a promptmill run.json.*guidence_scale"):
        runs.read(out)


def test_a_run_json_whose_scheduler_disagrees_with_its_settings_is_refused():
    stored = as_stored(run_of(SETTINGS))
    stored["scheduler"] = "ddim"
    with pytest.raises(ValueError, match="scheduler 'ddim'.*'euler'"):
        Run.from_dict(stored)


def test_a_run_json_whose_loras_disagree_with_its_settings_is_refused():
    stored = as_stored(run_of(SETTINGS))
    stored["loras"][0]["scale"] = 0.5
    with pytest.raises(ValueError, match="records the LoRA adapters.*0.5.*but its settings ask for.*0.8"):
        Run.from_dict(stored)
    # the adapters' paths and scales stay out of the settings fingerprint: the model fingerprint pins them
    assert fingerprint(SETTINGS, "m") == fingerprint(SETTINGS.replace(loras=()), "m")


def test_reading_an_unplanned_out_says_to_plan_first(tmp_path):
    with pytest.raises(runs.RunNotPlanned, match="run 'promptmill plan' for this --out first"):
        runs.read(str(tmp_path / "nothing"))
    assert not runs.exists(str(tmp_path))


@pytest.mark.parametrize("value, ok", [(8, True), (512, True), (1016, True), (12, True), (0, False), (-8, False),
                                       (8193, False), (2.0, False)])
def test_sizes_are_positive_whole_numbers_and_their_unit_is_the_familys(value, ok):
    """A size's unit is its model's (``families.size_problem``, at plan time); the benchmarks
    ask for multiples of 8."""
    if ok:
        assert check_size("width", value) == value
    else:
        with pytest.raises(ValueError, match="--width must be"):
            check_size("width", value)
    with pytest.raises(ValueError, match="--width must be a positive multiple of 8, got 12"):
        check_size("width", 12, 8)


def test_a_run_json_of_another_settings_version_is_refused_and_left_as_it_was(tmp_path):
    """No compatibility modes: a run.json without this version's settings version (an
    earlier promptmill's) is refused when read, naming its version and what to do."""
    out = str(tmp_path)
    stored = as_stored(run_of(SETTINGS))
    del stored["settings_version"]
    storage.write_json(naming.run_json(out), stored)
    before = storage.read_bytes(naming.run_json(out))
    with pytest.raises(runs.OtherVersion, match=r"settings version 1 \(by promptmill 0.1.0\), an earlier settings "
                                                r"version than this version's \(2\)"):
        runs.read(out)
    stored["settings_version"] = 3
    storage.write_json(naming.run_json(out), stored)
    with pytest.raises(runs.OtherVersion, match="a later settings version"):
        runs.read(out)
    assert runs.read_document(out, any_version=True)["settings_version"] == 3  # what --overwrite asks
    storage.write_bytes(naming.run_json(out), before)
    assert storage.read_bytes(naming.run_json(out)) == before
