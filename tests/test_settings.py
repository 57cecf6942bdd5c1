"""The one settings object: run.json round-trips into a typed Run, old run.json files
still read (and keep their fingerprint), and an unknown setting is an error."""
from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from pipeline.core import naming
from pipeline.core.settings import NEWER_SETTINGS, Lora, Run, Settings, check_size, fingerprint, parse_lora
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
                           "created_at", "loras", "scorers"}
    assert stored["scheduler"] == "euler" and stored["versions"] == {"jax": "0.10.2", "promptmill": "0.1.0"}
    assert stored["loras"] == [{"path": "gs://b/loras/style.safetensors", "scale": 0.8, "sha256": "a" * 64},
                               {"path": "/loras/lcm", "scale": 1.0, "sha256": "a" * 64}]
    assert runs.read(out) == run_of(SETTINGS)


def test_an_older_run_json_reads_with_the_defaults_and_keeps_its_fingerprint():
    """A run planned before the newer settings existed: they are missing from its
    run.json, take their defaults, and its stored fingerprint is still the one a plan
    with the same settings computes, so a re-run resumes it."""
    newer = {k: v for k, v in NEWER_SETTINGS.items() if k != "attention"}  # see the test below
    current = run_of(SETTINGS.replace(**newer))  # what those runs had
    old = as_stored(current)
    for name in newer:
        del old["settings"][name]
    del old["loras"]
    decisive = {k: v for k, v in old["settings"].items() if k != "out"}
    decisive["model"] = old["model_fingerprint"]
    old["settings_fingerprint"] = hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()
    read = Run.from_dict(old)
    assert read.settings == current.settings
    assert read.settings_fingerprint == old["settings_fingerprint"] == current.settings_fingerprint
    # a newer setting away from its default is part of the fingerprint
    assert fingerprint(current.settings.replace(dedupe=True), "f" * 64) != current.settings_fingerprint


def test_a_run_planned_before_the_attention_seam_is_refused_with_a_clear_error():
    """Its SD networks were diffusers' Flax modules: this version has none, so the run is
    refused instead of resumed with other networks."""
    old = as_stored(run_of(SETTINGS))
    del old["settings"]["attention"]
    with pytest.raises(ValueError, match="earlier promptmill version"):
        Run.from_dict(old)


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


def test_an_out_planned_before_the_newer_settings_resumes_and_other_settings_are_refused(tmp_path, model_cache):
    """The plan's resume check on a real OUT whose run.json an older version wrote."""
    from pipeline.plan import input_table, layout, prepare

    out = str(tmp_path / "out")
    _, run = prepare.resolve_settings(Settings(prompts=str(tmp_path / "*.jsonl"), out=out, steps=2))
    old = as_stored(run)
    for name in set(NEWER_SETTINGS) - {"attention"}:  # a run without it is refused (see above)
        del old["settings"][name]
    del old["loras"]
    old["created_at"] = "2025-01-01T00:00:00+00:00"
    old["settings_fingerprint"] = fingerprint(Settings.from_dict(old["settings"]), old["model_fingerprint"])
    input_table.record(out, str(tmp_path / "*.jsonl"))
    storage.write_json(naming.run_json(out), old)
    assert run.settings.guidance_rule == "diffusers"
    # --decode-batch auto keeps the old run's whole-batch decoding, as prepare does before resolving
    asked = Settings(prompts=str(tmp_path / "*.jsonl"), out=out, steps=2)
    assert prepare.kept_decode_batch(asked).decode_batch is None and run.settings.decode_batch == 1
    assert prepare.kept_decode_batch(asked.replace(decode_batch=2)).decode_batch == 2  # asked for: kept as asked
    run = prepare.resolve_settings(prepare.kept_decode_batch(asked))[1]
    resumed = prepare.prepare_out(out, run)
    assert resumed.created_at == "2025-01-01T00:00:00+00:00"  # the old run, kept: redone slices get its bytes
    assert resumed.settings.guidance_rule == "always"  # and the guidance rule it was planned with
    assert storage.read_json(naming.run_json(out)) == old  # run.json untouched
    _, other = prepare.resolve_settings(prepare.kept_decode_batch(
        Settings(prompts=str(tmp_path / "*.jsonl"), out=out, steps=3, dedupe=True)))
    with pytest.raises(layout.PlanError, match=r"already holds a run with other settings \(changed: dedupe, steps\)"):
        prepare.prepare_out(out, other)
