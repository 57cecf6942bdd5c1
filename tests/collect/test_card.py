"""The dataset card: front matter, sections, counts, and stats from older or newer runs."""
from __future__ import annotations

import pytest

from pipeline.collect import card
from pipeline.core.settings import Run

RUN_JSON = {
    "settings": {
        "prompts": "gs://bucket/prompts/*.jsonl", "out": "gs://bucket/out", "model": "/models/sd|v1-5 `mine`",
        "width": 512, "height": 512, "steps": 30, "scheduler": "dpm", "guidance_scale": 7.5, "seed": 1234,
        "per_device_batch": 4, "batches_per_slice": 2, "devices_per_host": 8, "dtype": "bf16",
        "formats": ["files", "webdataset"], "image_format": "webp", "quality": 90, "save_latents": False,
        "prompt_field": "prompt", "attention": "auto", "guided": True,
    },
    "model_fingerprint": "3f2a9c0d1e",
    "scheduler": "dpm",
    "settings_fingerprint": "ab12cd34",
    "versions": {"promptmill": "0.1.0", "jax": "0.4.30", "flax": "0.8.5", "diffusers": "0.29.2",
                 "apache-beam": "2.57.0"},
    "created_at": "2024-07-01T12:00:00+00:00",
}
RUN = Run.from_dict(RUN_JSON)

STATS = {
    "verified": True, "images": 12_345, "records": 6_200, "planned_images": 12_345, "rejects": 7,
    "rejects_by_reason": {"empty_prompt": 4, "bad_seed": 3}, "input_rows": 6_207, "slices": 193,
    "committed_slices": 193, "problems": {},
    "hosts": {"0": {"images": 6_200, "seconds": 620.0, "slices": 97, "images_per_s": 10.0},
              "1": {"images": 6_145, "seconds": 0.0, "slices": 96, "images_per_s": None}},
    "compiles_after_warmup": 0, "duplicates": 2, "truncated_prompts": 31,
}


def front_matter(text: str) -> str:
    lines = text.split("\n")
    assert lines[0] == "---"
    end = lines.index("---", 1)
    return "\n".join(lines[1:end])


def test_front_matter_is_hub_yaml():
    text = card.render(RUN, STATS)
    block = front_matter(text)
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML ships with the test environment
        assert "config_name: default" in block and "data_files: images/**" in block
        assert "- 10K<n<100K" in block
        return
    meta = yaml.safe_load(block)
    # the images with their prompts (images/** and each slice's metadata.jsonl, imagefolder), marked as collect's
    assert meta["configs"] == [{"config_name": "default", "data_files": "images/**", "drop_labels": True}]
    assert card.MARKER in block.split("\n") and card.is_ours(text) and not card.is_ours("# my notes\n")
    assert meta["task_categories"] == ["text-to-image"]
    assert meta["size_categories"] == ["10K<n<100K"]


def test_a_dataset_without_images_points_its_config_at_the_rows_and_says_why():
    """No image kept (every one dropped by a filter): image builders refuse a folder without
    images, so the default config reads the metadata parts, and the card says so."""
    kept_none = {**STATS, "images": 0, "dropped": {"images": 12_345, "by_rule": {"min_aesthetic": 12_345}}}
    text = card.render(RUN, kept_none)
    assert "  data_files: dataset/metadata/*.parquet" in front_matter(text).split("\n")
    assert "No image was kept" in text and "`imagefolder`" in text
    assert "  data_files: images/**" in front_matter(card.render(RUN, STATS)).split("\n")
    assert "every image" in card.all_dropped(kept_none) and card.all_dropped(STATS) is None


@pytest.mark.parametrize("images, label", [(0, "n<1K"), (999, "n<1K"), (1_000, "1K<n<10K"), (12_345, "10K<n<100K"),
                                           (1_000_000, "1M<n<10M"), (5_000_000_000, "n>1B")])
def test_size_category(images, label):
    assert card.size_category(images) == label


def test_sections_and_settings():
    text = card.render(RUN, STATS)
    headings = [line for line in text.split("\n") if line.startswith("#") and line != card.MARKER]
    assert headings == ["# promptmill dataset", "## What it is", "## How it was generated", "## Counts",
                        "## How to load it", "## How to reproduce an image"]
    for needed in ("| promptmill | `0.1.0` |", "| model fingerprint | `3f2a9c0d1e` |", "| scheduler | `dpm` |",
                   "| steps | `30` |", "| guidance scale | `7.5` |", "| size (width x height) | `512 x 512` |",
                   "| dtype | `bf16` |", "| run seed | `1234` |", "| formats | `files, webdataset` |",
                   "| image format | `webp (quality 90)` |", "| planned at | `2024-07-01T12:00:00+00:00` |",
                   "`jax` `0.4.30`", 'load_dataset("OUT", split="train")',
                   'data_files="OUT/dataset/metadata/*.parquet"',
                   "import pyarrow.parquet as pq", "promptmill reproduce KEY [KEY ...] --out OUT",
                   "| timestep spacing | `the checkpoint's` |",
                   "| classifier-free guidance | `yes (some record's guidance > 1)` |"):  # an older run: guided
        assert needed in text, needed
    assert "UNet weights" not in text
    fast = Run.from_dict({**RUN_JSON, "settings": {**RUN_JSON["settings"], "guided": False, "guidance_rule": "diffusers",
                                                   "timestep_spacing": "trailing", "unet": "gs://b/unet.safetensors"}})
    text = card.render(fast, STATS)
    for needed in ("| timestep spacing | `trailing` |", "| UNet weights | `gs://b/unet.safetensors` |",
                   "| classifier-free guidance | `no: guidance-free (every record's guidance <= 1)` |"):
        assert needed in text, needed
    assert "LoRA adapters" not in text
    adapted = Run.from_dict({**RUN_JSON, "settings": {**RUN_JSON["settings"], "loras": ["gs://b/lcm@1.0",
                                                                                       "/style.safetensors@0.5"]},
                             "loras": [{"path": "gs://b/lcm", "scale": 1.0, "sha256": "0123456789ab" + "f" * 52},
                                       {"path": "/style.safetensors", "scale": 0.5, "sha256": "e" * 64}]})
    assert ("| LoRA adapters | `gs://b/lcm at scale 1 (sha256 0123456789ab); /style.safetensors at scale 0.5 "
            "(sha256 eeeeeeeeeeee)` |") in card.render(adapted, STATS)


def test_model_path_is_escaped():
    text = card.render(RUN, STATS)
    # a code span longer than the backtick run inside, and the table's pipe escaped
    assert "| model | `` /models/sd\\|v1-5 `mine` `` |" in text
    hostile = Run.from_dict(dict(RUN_JSON, settings=dict(RUN_JSON["settings"],
                                                         model="<img src=x onerror=alert(1)>\nline")))
    text = card.render(hostile, STATS)
    assert "\n<img" not in text and "`<img src=x onerror=alert(1)> line`" in text


def test_counts_appear():
    text = card.render(RUN, STATS)
    for needed in ("| input rows | 6,207 |", "| records | 6,200 |", "| images | 12,345 |", "| rejected rows | 7 |",
                   "| duplicates | 2 |", "| truncated prompts | 31 |", "| `empty_prompt` | 4 |",
                   "| `bad_seed` | 3 |", "| `0` | 97 | 6,200 | 620.0 | 10.000 |", "| `1` | 96 | 6,145 | 0.0 | – |"):
        assert needed in text, needed
    assert text.index("`bad_seed`") < text.index("`empty_prompt`")


def test_missing_optional_stats_do_not_crash():
    minimal = {"images": 3, "records": 3, "input_rows": 3, "rejects": 0, "rejects_by_reason": {}}
    text = card.render(RUN, minimal)
    assert "| images | 3 |" in text and "| rejected rows | 0 |" in text
    assert "duplicates" not in text and "truncated prompts" not in text and "images/s" not in text
    # run.json of the oldest runs: settings added later are missing
    text = card.render(Run.from_dict({"settings": {"model": "tiny", "attention": "auto"}, "model_fingerprint": "m",
                                      "created_at": "2024-01-01T00:00:00+00:00"}), {})
    assert "| images | 0 |" in text and "- n<1K" in text and "| model | `tiny` |" in text
