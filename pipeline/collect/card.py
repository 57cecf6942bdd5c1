"""The dataset card: ``OUT/README.md``, written by collect (a pure function).

A dataset is only useful if a reader can tell what it is, how it was made, and how
to load it. The card is Markdown with the YAML front matter that the Hugging Face
Hub and ``datasets.load_dataset(OUT)`` read: its ``default`` config points at the files
that hold the images with their prompts (``data_files``: ``images/**`` read by the
``imagefolder`` builder with each slice folder's ``metadata.jsonl``, else the image
parquet files, else the WebDataset tars, else the metadata parts; a dataset that kept
no image, the metadata parts, and the card says why). One config only: ``datasets`` reads every config of a
folder with the builder it infers for the default one. Its front matter holds ``MARKER``: collect rewrites a
card that has it and refuses to overwrite an ``OUT/README.md`` that does not (a
user's). Then comes what the
dataset is, how it was generated (from ``run.json``), its counts (from
``stats.json``), how to load it and how to reproduce an image.

Values that come from users (model paths, reasons, versions) go into code spans,
whose content Markdown shows verbatim; table cells also escape ``|``. Optional
stats (``duplicates``, ``truncated_prompts``, ...) are shown only when present, so
a card can be written from the stats of any version.
"""
from __future__ import annotations

import re

from pipeline import __version__
from pipeline.core import filters, naming
from pipeline.core.settings import Run
from pipeline.model import families

# The Hub's size categories: (upper bound, exclusive; label).
_SIZES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M"),
          (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"), (1_000_000_000, "100M<n<1B"))


def size_category(images: int) -> str:
    """The Hub's ``size_categories`` label for ``images`` rows."""
    for bound, label in _SIZES:
        if images < bound:
            return label
    return "n>1B"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def visible(text: str) -> str:
    """``text`` with every control character (C0 but tab and newline, DEL, C1), lone
    surrogate and noncharacter written as a visible escape (``\\x00``, ``\\ud800``): a
    prompt's NUL or terminal escape never reaches an HTML or Markdown output raw."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                        else f"\\u{ord(m.group()):04x}", text)


def code(value) -> str:
    """``value`` as a Markdown code span, shown verbatim whatever it holds (control
    characters made ``visible``)."""
    text = " ".join(visible(str(value)).replace("\t", " ").split("\n"))
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _count(value) -> str:
    if isinstance(value, dict) and value and all(isinstance(v, int) for v in value.values()):
        return ", ".join(f"{v:,} {name}" for name, v in value.items())  # e.g. {records, images}
    return f"{value:,}" if isinstance(value, int) else "–"


# A YAML comment in the card's front matter: a README.md holding it is promptmill's to rewrite
MARKER = naming.CARD_MARKER
is_ours = naming.is_our_card


METADATA_PARTS = "dataset/metadata/*.parquet"


def image_files(formats, images: int = 1) -> tuple[str, list[str]]:
    """The ``default`` config's ``data_files`` pattern for a run writing ``formats`` that
    kept ``images`` images, and its builder's options (YAML lines): the files that hold the
    images with their rows; the metadata parts when no file holds an image (zarr alone, or
    no image kept: the builders of image files refuse a folder without one)."""
    if not images:
        return METADATA_PARTS, []
    if "files" in formats:  # images/SLICE/KEY.EXT + images/SLICE/metadata.jsonl (imagefolder)
        return "images/**", ["  drop_labels: true"]
    if "parquet" in formats:  # metadata rows and an Image column
        return "parquet/*.parquet", []
    if "webdataset" in formats:  # KEY.EXT, KEY.json, KEY.txt per sample
        return "shards/*.tar", []
    return METADATA_PARTS, []  # zarr alone: no image file; the rows


def _front_matter(images: int, formats=("files",)) -> list[str]:
    pattern, options = image_files(formats, images)
    return [
        "---",
        MARKER,
        "configs:",
        "- config_name: default",
        f"  data_files: {pattern}",
        *options,
        "task_categories:",
        "- text-to-image",
        "size_categories:",
        f"- {size_category(images)}",
        "tags:",
        "- synthetic",
        "- promptmill",
        "---",
    ]


def _with_fingerprint(path, fingerprint) -> str | None:
    return None if fingerprint is None else f"{path} (fingerprint {fingerprint[:12]})"


def _filters(settings) -> list[str]:
    """The filters the run applied (``filters.active_rules``), as what an image must meet."""
    found = []
    for rule in filters.active_rules(settings):
        if rule == "drop_nsfw":
            found.append("not flagged by the safety checker")
        else:
            found.append(f"{filters.RULES[rule]} >= {getattr(settings, rule):g}")
    return found


def _generation(run: Run) -> list[str]:
    settings = run.settings
    rule = families.guidance_rule(settings.guidance_rule)
    scorers = dict(run.scorers)
    versions = dict(run.versions)
    quality = f" (quality {settings.quality})" if settings.image_format != "png" else ""
    rows = [
        ("promptmill", versions.get("promptmill", __version__)),
        ("model", settings.model),
        ("UNet weights", settings.unet),
        ("LoRA adapters", "; ".join(f"{lora.path} at scale {lora.scale:g} (sha256 {lora.sha256[:12]})"
                                    for lora in run.loras) or None),
        ("model fingerprint", run.model_fingerprint),
        ("scheduler", run.scheduler),
        ("timestep spacing", settings.timestep_spacing or "the checkpoint's"),
        ("steps", settings.steps),
        ("guidance scale", settings.guidance_scale),
        ("guidance", rule.meaning),
        ("classifier-free guidance", None if not rule.classifier_free else {
            True: f"yes (some record's guidance > {rule.above:g})",
            False: f"no: guidance-free (every record's guidance <= {rule.above:g})"
        }.get(settings.guided)),
        ("text sequence length (tokens)", settings.max_sequence_length),
        ("FSDP (weights sharded over N devices)", settings.fsdp if settings.fsdp != 1 else None),
        ("sharded components", ", ".join(name for name, where in (run.sharding or {}).items()
                                         if where.get("placement", "").startswith("sharded")) or None),
        ("model licence", run.license),
        ("size (width x height)", f"{settings.width} x {settings.height}" if not settings.sizes else None),
        ("sizes (width x height; the first is the default)", ", ".join(settings.sizes) or None),
        ("dtype", settings.dtype),
        ("attention", settings.attention),
        ("run seed", settings.seed),
        ("formats", ", ".join(settings.formats)),
        ("image format", f"{settings.image_format}{quality}"),
        ("per-device batch", settings.per_device_batch if not settings.bucket_batches else
         ", ".join(f"{size}: {batch}" for size, batch in zip(settings.sizes, settings.bucket_batches))),
        ("VAE decode batch (images decoded at once)", settings.decode_batch if settings.decode_batch is not None
         else "the whole per-device batch"),
        ("scores", ", ".join(settings.scores) or None),
        ("CLIP model", _with_fingerprint(settings.clip_model, scorers.get("clip"))),
        ("aesthetic head", _with_fingerprint(settings.aesthetic_head, scorers.get("aesthetic"))),
        ("safety checker", _with_fingerprint(settings.safety_checker or "the model's safety_checker/",
                                             scorers.get("safety"))),
        ("filters", "; ".join(_filters(settings)) or None),
        ("settings fingerprint", run.settings_fingerprint),
        ("planned at", run.created_at),
    ]
    lines = ["## How it was generated", "",
             "Every image was generated by promptmill with a diffusion model in JAX, "
             "from the settings in `run.json`:", "",
             "| setting | value |", "| --- | --- |"]
    lines += [f"| {name} | {_cell(code(value))} |" for name, value in rows if value is not None]
    others = {name: version for name, version in sorted(versions.items()) if name != "promptmill"}
    if others:
        lines += ["", "Library versions: " + ", ".join(f"{code(name)} {code(v)}" for name, v in others.items()) + "."]
    lines += ["", "A record without a seed of its own gets one derived from the run seed and its id, so every "
              "image's seed is in the metadata (`seed`)."]
    return lines


def _counts(stats: dict) -> list[str]:
    lines = ["## Counts", "", "| | count |", "| --- | ---: |"]
    for name, key in (("input rows", "input_rows"), ("records", "records"), ("images", "images"),
                      ("planned images", "planned_images"), ("rejected rows", "rejects"),
                      ("duplicates", "duplicates"), ("truncated prompts", "truncated_prompts"),
                      ("negative prompts unused", "negative_prompts_unused"), ("guidance unused", "guidance_unused"),
                      ("slices", "slices")):
        if key in stats or key in ("images", "records", "input_rows", "rejects"):
            lines.append(f"| {name} | {_count(stats.get(key, 0))} |")
    dropped = stats.get("dropped")
    if dropped and not dropped.get("images"):
        lines += ["", "The score filters dropped no image."]
    elif dropped:
        kept = stats.get("image_conservation", {})
        lines += ["", f"Dropped by the score filters: {_count(dropped.get('images'))} image(s), each with its "
                      f"metadata row (its `dropped` column says which rule and value) and in no image output; "
                      f"planned images = images + dropped: "
                      f"{'yes' if kept.get('holds') else 'no'}.", "",
                  "| rule | images |", "| --- | ---: |"]
        by_rule = sorted((dropped.get("by_rule") or {}).items())
        lines += [f"| {_cell(code(rule))} | {_count(n)} |" for rule, n in by_rule]
    sizes = stats.get("sizes") or {}
    if sizes:
        lines += ["", "Images by size (the run's aspect-ratio buckets):", "",
                  "| size | records | planned images | images | dropped | per-device batch |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {_cell(code(size))} | {_count(c.get('records'))} | {_count(c.get('planned_images'))} | "
                  f"{_count(c.get('images'))} | {_count(c.get('dropped'))} | {_count(c.get('per_device_batch'))} |"
                  for size, c in sizes.items()]
    reasons = stats.get("rejects_by_reason") or {}
    if reasons:
        lines += ["", "Rejected rows by reason:", "", "| reason | rows |", "| --- | ---: |"]
        lines += [f"| {_cell(code(reason))} | {_count(n)} |" for reason, n in sorted(reasons.items())]
    hosts = stats.get("hosts") or {}
    if hosts:
        lines += ["", "Generation speed per host:", "", "| host | slices | images | seconds | images/s |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for host, h in sorted(hosts.items(), key=lambda item: (len(str(item[0])), str(item[0]))):
            seconds = h.get("seconds")
            rate = h.get("images_per_s")
            lines.append(f"| {_cell(code(host))} | {_count(h.get('slices'))} | {_count(h.get('images'))} | "
                         f"{f'{seconds:,.1f}' if isinstance(seconds, (int, float)) else '–'} | "
                         f"{f'{rate:,.3f}' if isinstance(rate, (int, float)) else '–'} |")
    return lines


def _scores(stats: dict) -> list[str]:
    """The scores' quantiles over every scored image, kept or dropped."""
    scores = {name: value for name, value in (stats.get("scores") or {}).items() if "quantiles" in value}
    if not scores:
        return []
    names = list(next(iter(scores.values()))["quantiles"])
    lines = ["## Scores", "", "Computed for every image on the devices that made it (kept or dropped); the "
             "columns `clip_similarity`, `aesthetic`, `nsfw_score` and `nsfw` of `dataset/metadata/`.", "",
             "| score | images | mean | min | " + " | ".join(names) + " | max |",
             "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " | ---: |"]
    for name, value in scores.items():
        cells = [f"{value['quantiles'][q]:.4f}" for q in names]
        lines.append(f"| {_cell(code(name))} | {_count(value['count'])} | {value['mean']:.4f} | {value['min']:.4f} | "
                     + " | ".join(cells) + f" | {value['max']:.4f} |")
    flagged = (stats.get("scores") or {}).get("nsfw")
    if flagged:
        lines += ["", f"Flagged by the safety checker (`nsfw`): {_count(flagged.get('flagged'))} image(s)."]
    return lines


def all_dropped(stats: dict) -> str | None:
    """The warning for a dataset whose score filters dropped every image made, else None."""
    dropped = (stats.get("dropped") or {}).get("images", 0)
    if stats.get("images") or not dropped:
        return None
    rules = ", ".join(f"{rule} ({n})" for rule, n in (stats["dropped"].get("by_rule") or {}).items())
    return (f"the score filters dropped every image ({dropped} of {dropped}; by rule: {rules}): the dataset holds "
            f"their metadata rows and no image; loosen the filters (or drop them) to keep images")


def render(run: Run, stats: dict) -> str:
    """The card of a dataset planned with ``run`` (run.json) and collected into ``stats`` (stats.json)."""
    images = stats.get("images", 0)
    formats = run.settings.formats
    lines = _front_matter(images if isinstance(images, int) else 0, formats)
    pattern, _ = image_files(formats, images)
    lines += [
        "", "# promptmill dataset", "",
        f"Synthetic images generated from text prompts with {code(run.settings.model)}: "
        f"{_count(images)} image(s) from {_count(stats.get('records', 0))} prompt record(s).", "",
        "## What it is", "",
        "`dataset/metadata/` has one row per image, in parts (`part-NNNNN.parquet`, each the rows of a range of "
        "slices, in plan order), which pandas, pyarrow and DuckDB read as one table: each row's `key`, `prompt`, "
        "`negative_prompt`, `seed` and every generation setting, the `sha256` of its bytes, and `path`, where "
        "the image is, relative to this folder (the run's output folder). A `path` with `#` names an image "
        "inside a file: a WebDataset tar member (`shards/SLICE.tar#KEY.EXT`), a parquet row "
        "(`parquet/SLICE.parquet#KEY`) or a zarr index (`zarr/images#POSITION`; `zarr/key` holds each "
        "position's key). `dataset/index/` finds a key's part, row group and row by reading one small file "
        "(the bucket of a hash of the key). `dataset/index.html` is a gallery of a sample of thumbnails; "
        "`dataset/stats.json` has the counts below.", "",
    ]
    if "files" in formats and images:
        lines += ["Each folder `images/SLICE/` has a `metadata.jsonl`, one line per image file: its `file_name` and "
                  "its metadata row, so that the `imagefolder` builder reads the images with their prompts.", ""]
    if not images:
        lines += ["No image was kept (the score filters dropped every one, or none was made): the `imagefolder`, "
                  "`webdataset` and parquet image builders refuse a folder without images, so this card's "
                  "`default` config reads the metadata parts instead, each row with its `dropped` reason.", ""]
    lines += _generation(run)
    lines += [""] + _counts(stats)
    score_lines = _scores(stats)
    if score_lines:
        lines += [""] + score_lines
    lines += [
        "", "## How to load it", "",
        "With pyarrow:", "",
        "```python",
        "import pyarrow.parquet as pq",
        "",
        'rows = pq.read_table("dataset/metadata").to_pylist()',
        'print(rows[0]["prompt"], rows[0]["path"])',
        "```", "",
        "With 🤗 Datasets (this folder: its `default` config is the images, "
        f"`{pattern}`, with their prompts; `dataset/metadata/` the rows alone):", "",
        "```python",
        "from datasets import load_dataset",
        "",
        'ds = load_dataset("OUT", split="train")',
        'rows = load_dataset("parquet", data_files="OUT/dataset/metadata/*.parquet", split="train")',
        "```", "",
        "## How to reproduce an image", "",
        "Every image is determined by its metadata row. To regenerate images and check their bytes against "
        "the recorded `sha256` (with the same model and library versions):", "",
        "```sh",
        "promptmill reproduce KEY [KEY ...] --out OUT [--save DIR]",
        "```", "",
        "where `KEY` is a value of the `key` column and `OUT` the run's output folder or `gs://` prefix.", "",
    ]
    return "\n".join(lines)
