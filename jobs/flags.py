"""The flags more than one command shares and their translation into Settings.

Flags are strict (DESIGN.md, "Trust"): every promptmill parser is a ``Parser``, which takes no
abbreviation (``--ste`` is not ``--steps``) and refuses a flag that takes one value when it is given
twice (``--steps 1 --steps 2``: which one was meant?), naming both values; ``--lora`` repeats.
What a parser did not take (Beam's options, typos, the positional OUT) is checked by
``jobs.strict``.
"""
from __future__ import annotations

import argparse

from pipeline.core.choices import (
    ATTENTIONS,
    DTYPES,
    FORMATS,
    IMAGE_FORMATS,
    SCHEDULERS,
    SCORES,
    TIMESTEP_SPACINGS,
    parse_formats,
    parse_scores,
)
from pipeline.core.settings import AUTO, Settings, lora_spec, parse_lora
from pipeline.model.families import (BUILTINS, guidance_help, sequence_help, shapes_only_builtins, size_rules,
                                     steps_help, titles)
from pipeline.model.scorers import presets as scorer_presets

_DEFAULTS = Settings()
_GIVEN = "flags_given_"  # the namespace attribute where a parse keeps the flags it took: {dest: (flag, value)}


class _Once:
    """An action that takes a flag once per parse (mixed into argparse's store actions).

    A second occurrence of the flag (or of another flag with the same dest) is an error naming
    both values: argparse would keep the last one and drop the first in silence. Positionals
    are left to argparse."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None:
            given = getattr(namespace, _GIVEN, None)
            if given is None:
                given = {}
                setattr(namespace, _GIVEN, given)
            if self.dest in given:
                raise argparse.ArgumentError(None, given_twice(given[self.dest], (option_string, values),
                                                               self.nargs == 0))
            given[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


def given(args: argparse.Namespace) -> dict:
    """{dest: (flag, value)} of the single-valued flags this parse took from the command line
    (not their defaults)."""
    return getattr(args, _GIVEN, None) or {}


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def given_twice(first: tuple[str, object], second: tuple[str, object], bare: bool) -> str:
    """The error for a flag that takes one value given twice: ``--steps given twice (1 and 2): give it once``."""
    (flag, old), (again, new) = first, second
    values = "" if bare else f" ({_shown(old)} and {_shown(new)})"
    if flag == again:
        return f"{flag} given twice{values}: give it once"
    return f"{flag} and {again} are one flag, given twice{values}: give it once"


# argparse's own store actions (its private classes, which ``action="store"`` and the like name): the
# flags keep their behaviour, and only the once-check is added
class _StoreOnce(_Once, argparse._StoreAction):
    pass


class _StoreConstOnce(_Once, argparse._StoreConstAction):
    pass


class _StoreTrueOnce(_Once, argparse._StoreTrueAction):
    pass


class _StoreFalseOnce(_Once, argparse._StoreFalseAction):
    pass


_ONCE_ACTIONS = {None: _StoreOnce, "store": _StoreOnce, "store_const": _StoreConstOnce,
                 "store_true": _StoreTrueOnce, "store_false": _StoreFalseOnce}


class Parser(argparse.ArgumentParser):
    """Every promptmill parser, subcommands included (``add_subparsers`` makes its parsers of
    the parent's class). No abbreviations (``allow_abbrev`` is always off: ``--ste`` is not
    ``--steps``), and every single-valued flag (store, store_true, store_const, store_false)
    is taken once: given twice, it is an error naming both values, never last-wins. Flags that
    accumulate (``action="append"``, e.g. ``--lora``) still do."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        for name, action in _ONCE_ACTIONS.items():
            self.register("action", name, action)


class _RaisingParser(Parser):
    """A Parser whose errors are ValueErrors (for flags read back in-process, not typed by a user)."""

    def error(self, message):
        raise ValueError(f"{self.prog}: {message}")


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of every Settings field (``settings_from_args`` reads them back)."""
    d = _DEFAULTS
    parser.add_argument("--prompts", default=d.prompts,
                        help="prompt file, folder, glob or gs:// path; formats by extension: .jsonl, .json, .txt, "
                             ".csv, .tsv, .parquet, each optionally .gz (default: %(default)s)")
    parser.add_argument("--prompt-field", default=d.prompt_field,
                        help="the prompt's column or key in jsonl, json, csv, tsv and parquet files; a .txt line is "
                             "a prompt (default: %(default)s)")
    parser.add_argument("--dedupe", action="store_true",
                        help="reject a record whose prompt an earlier record (in file and line order) already has, "
                             "as duplicate_prompt; counted in the stats")
    parser.add_argument("--out", default=d.out, help="output folder or gs://bucket/prefix (default: %(default)s)")
    parser.add_argument("--model", default=d.model,
                        help=f"diffusers-format checkpoint ({titles()}): a local folder, a gs:// "
                             "prefix (copied once into the local cache), a Hugging Face id where the network allows, "
                             f"or a built-in random model ({', '.join(BUILTINS)}: random weights, so their "
                             f"images are noise; for tests, demos and benchmarks; "
                             f"{', '.join(shapes_only_builtins())} have shapes only, for the TPU check and "
                             f"benchmarks) (default: %(default)s)")
    parser.add_argument("--unet", metavar="PATH", default=None,
                        help="a UNet-only .safetensors file (local or gs://) whose weights replace the model's UNet, "
                             "e.g. a distilled few-step UNet into its base model; part of the run's fingerprint")
    parser.add_argument("--lora", metavar="PATH[@SCALE]", action="append", default=None,
                        help="a LoRA adapter merged into the weights once, at load (no cost per image): a "
                             ".safetensors file or a folder holding pytorch_lora_weights.safetensors, local or gs://, "
                             "in diffusers/PEFT or kohya format, for the denoiser and text encoders; SCALE defaults to "
                             "1.0. Repeat it to merge several, in order. Each file's sha256 and scale are recorded in "
                             "run.json and the metadata, and are part of the run's fingerprint")
    for side in ("width", "height"):
        parser.add_argument(f"--{side}", type=int, default=None,
                            help=f"image {side} in pixels, a multiple of the model's size unit ({size_rules()}) "
                                 f"(default: the model's)")
    parser.add_argument("--sizes", type=sizes_flag, default=None, metavar="WxH[,WxH...]|common",
                        help="the run's image sizes (aspect-ratio buckets), each compiled once: the first is the "
                             "default; a record may ask for one by width and height (which must be one of them) or "
                             "by aspect_ratio (\"3:4\" is width:height, or a number: the nearest size). common: "
                             "1024x1024, 1152x896, 896x1152, 1216x832, 832x1216, 1344x768, 768x1344, 1536x640, "
                             "640x1536, scaled to the model's native area and rounded to its size unit. Without "
                             "--sizes, a record's width, height and aspect_ratio only pass through to its metadata "
                             "(default: one size, --width x --height)")
    parser.add_argument("--steps", type=int, default=d.steps,
                        help=f"denoising steps (default: the model's: {steps_help()}; a resumed run keeps its own)")
    parser.add_argument("--scheduler", choices=list(SCHEDULERS), default=None,
                        help="sampling algorithm (default: the checkpoint's own; euler_a: Euler ancestral, as "
                             "adversarially distilled turbo models ship; lcm: LCM multistep, for LCM and LCM-LoRA "
                             "models; flow_euler: flow-matching Euler, the only one of the rectified-flow families)")
    parser.add_argument("--timestep-spacing", choices=list(TIMESTEP_SPACINGS), default=None,
                        help="how the sampler's timesteps spread over the training schedule (trailing: few-step "
                             "distilled models; default: the checkpoint's scheduler config)")
    parser.add_argument("--attention", choices=list(ATTENTIONS), default=d.attention,
                        help="attention kernels: xla (the whole tokens x tokens matrix), chunked (exact, a block of "
                             "queries at a time: high resolutions in bounded memory), flash (Pallas on TPU, cuDNN on "
                             "GPU), auto (per call, from the platform and the shapes) (default: %(default)s)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=d.dtype,
                        help="network weights and compute dtype; latents stay float32 (default: %(default)s)")
    parser.add_argument("--format", default=",".join(d.formats),
                        help=f"output formats, comma-separated in one --format (given twice, it is an error): "
                             f"{', '.join(FORMATS)} (default: %(default)s)")
    parser.add_argument("--image-format", choices=list(IMAGE_FORMATS), default=d.image_format,
                        help="image encoding (default: %(default)s)")
    parser.add_argument("--quality", type=int, default=d.quality,
                        help="jpeg and webp quality, 1-100 (default: %(default)s)")
    parser.add_argument("--save-latents", action="store_true",
                        help="with --format zarr: also write each image's final latents (float32, before VAE "
                             "decoding) to OUT/zarr/latents")
    parser.add_argument("--guidance-scale", type=float, default=d.guidance_scale,
                        help=f"guidance scale for records without one, as the model's family means it: "
                             f"{guidance_help()}; a scale a model takes none of is counted in the stats and said on "
                             f"the card (default: the model family's)")
    parser.add_argument("--max-sequence-length", type=int, default=d.max_sequence_length, metavar="N",
                        help=f"the text tokens a prompt is encoded to, for families whose text encoder takes a "
                             f"length ({sequence_help()}); a longer prompt is cut and counted (default: the family's)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="run seed, hashed with a record's id when the record has no seed (default: %(default)s)")
    parser.add_argument("--per-device-batch", type=per_device_batch, default=d.per_device_batch,
                        help="images per device per step; with --sizes, one per size (N,N,...) or one for every "
                             "size; or auto: the largest whose compiled sampler (weights, inputs, temporaries) fits "
                             "one device of the machine that plans, for each size, measured from the compiled "
                             "program before planning and logged (default: %(default)s)")
    parser.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                        help="one device's memory in GiB, for --per-device-batch auto, --fsdp auto and a "
                             "submission's TPU check; plan records it in run.json, where a submission's check after "
                             "its plan reads it (default: the device's own figure, for a TPU chip what XLA reports "
                             "usable of its HBM; CPU devices share the machine's memory)")
    parser.add_argument("--fsdp", type=fsdp_degree, default=d.fsdp, metavar="N|auto",
                        help="shard each host's weights over groups of N of its devices (FSDP), gathered layer by "
                             "layer as they are used; every device still computes its own images. N divides the "
                             "devices per host; auto: the smallest N at which one image per device fits (for a "
                             "submission, on the target TPU chip). 1: a whole copy on every device "
                             "(default: %(default)s)")
    parser.add_argument("--decode-batch", type=decode_batch, default=d.decode_batch, metavar="N|auto",
                        help="the VAE decodes each device's images N at a time, one micro-batch after another, so "
                             "that the denoiser, not the decoder, bounds --per-device-batch (at 1024x1024 the "
                             "decoder's temporaries grow fastest with the batch); auto: 1. It can move a pixel by "
                             "a level or two against decoding the whole batch at once, so it is recorded in run.json "
                             "and each image's metadata, and a resumed run keeps its own (a run planned before it "
                             "existed decodes whole batches) (default: %(default)s)")
    parser.add_argument("--batches-per-slice", type=batches_per_slice, default=d.batches_per_slice, metavar="N|auto",
                        help="device steps per slice; slice size = devices per host x per-device batch x this. auto: "
                             "2 for a run of fewer than a million images; from a million, about 1,024 images a slice "
                             "(fewer, larger slices: fewer objects and listings per image). Decided when planning and "
                             "recorded in run.json; a resumed run keeps its own (default: %(default)s)")
    parser.add_argument("--score", default="",
                        help=f"scores computed for every image on the devices that made it, comma-separated in one "
                             f"--score (given twice, it is an error): "
                             f"{', '.join(SCORES)}. clip: clip_similarity, the cosine of the image's and the prompt's "
                             f"CLIP embeddings (--clip-model); aesthetic: LAION's aesthetic predictor on CLIP's image "
                             f"embedding (--clip-model, --aesthetic-head); safety: nsfw and nsfw_score, diffusers' "
                             f"safety checker (--safety-checker, default the model's own safety_checker/). Written "
                             f"to the metadata; they never change an image")
    parser.add_argument("--clip-model", metavar="PATH", default=None,
                        help="CLIP in transformers' format (Flax msgpack or safetensors): a local folder, gs:// "
                             "prefix, Hugging Face id (openai/clip-vit-large-patch14 is the usual one) or a built-in "
                             f"random one ({', '.join(scorer_presets.CLIPS)}; their scores mean nothing)")
    parser.add_argument("--aesthetic-head", metavar="PATH", default=None,
                        help="LAION's improved aesthetic predictor as a safetensors file with its state dict's names "
                             "(layers.0.weight, ...; docs/scores.md says how to make it from the .pth), local or gs://, "
                             f"or a built-in random one ({', '.join(scorer_presets.HEADS)})")
    parser.add_argument("--safety-checker", metavar="PATH", default=None,
                        help="diffusers' safety checker: a safety_checker folder or a checkpoint holding one, local, "
                             "gs:// or a hub id, or a built-in random one "
                             f"({', '.join(scorer_presets.CHECKERS)}) (default: the model's own safety_checker/)")
    parser.add_argument("--min-clip-similarity", type=float, default=None, metavar="X",
                        help="keep only images whose clip_similarity is >= X (LAION-5B used 0.28 with ViT-B/32); "
                             "the others go to no image output, and their metadata rows say why (dropped)")
    parser.add_argument("--min-aesthetic", type=float, default=None, metavar="Y",
                        help="keep only images whose aesthetic score is >= Y; the others' rows say why (dropped)")
    parser.add_argument("--drop-nsfw", action="store_true",
                        help="keep out of every image output the images the safety checker flags; their rows say "
                             "why (dropped)")


def sizes_flag(text: str) -> tuple[str, ...]:
    """``--sizes``: WxH[,WxH...] or common (``buckets.parse_sizes``)."""
    from pipeline.core import buckets

    try:
        return buckets.parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fsdp_degree(text: str) -> int | str:
    """``--fsdp``: a whole number, or ``auto``."""
    return per_device_batch(text)


def batches_per_slice(text: str) -> int | str:
    """``--batches-per-slice``: a whole number, or ``auto``."""
    return per_device_batch(text)


def decode_batch(text: str) -> int | str:
    """``--decode-batch``: a whole number, or ``auto``."""
    found = per_device_batch(text)
    if isinstance(found, tuple):
        raise argparse.ArgumentTypeError(f"expected a whole number or {AUTO}, got {text!r}")
    return found


def per_device_batch(text: str) -> int | str | tuple[int, ...]:
    """``--per-device-batch``: a whole number, ``auto``, or one whole number per size of
    ``--sizes`` (``N,N,...``: what ``auto`` chose for each, as a submission's plan is given it)."""
    if text == AUTO:
        return AUTO
    try:
        return tuple(int(part) for part in text.split(",")) if "," in text else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, one per size (N,N,...) or {AUTO}, "
                                         f"got {text!r}") from None


def _batches(value) -> dict:
    """Settings' per-device batch of ``--per-device-batch``, and each size's where it gives one per size."""
    if isinstance(value, tuple):
        return {"per_device_batch": value[0], "bucket_batches": value}
    return {"per_device_batch": value}


def settings_from_args(args: argparse.Namespace, devices_per_host: int, tpu_check: bool = False) -> Settings:
    """The one translation of the settings flags (``add_settings_flags``) into Settings; its
    inverse is ``pipeline.cloud.gke.settings_flags``. ``tpu_check``: settings a TPU check reads,
    which takes ``--device-memory`` as the chip's: a submission's, or a plan's (``run.json``
    keeps it for the check a submission repeats after its plan); elsewhere ``--device-memory``
    is refused unless ``--per-device-batch auto`` or ``--fsdp auto`` reads it."""
    if args.device_memory is not None and AUTO not in (args.per_device_batch, args.fsdp) and not tpu_check:
        raise ValueError(f"--device-memory is read only by --per-device-batch auto and --fsdp auto, and "
                         f"--per-device-batch is {args.per_device_batch}, --fsdp {args.fsdp}")
    return Settings(prompts=args.prompts, out=args.out, model=args.model, unet=args.unet,
                    loras=tuple(lora_spec(*parse_lora(spec)) for spec in args.lora or ()), width=args.width,
                    height=args.height, sizes=tuple(args.sizes or ()), steps=args.steps, scheduler=args.scheduler,
                    timestep_spacing=args.timestep_spacing, attention=args.attention, dtype=args.dtype,
                    formats=parse_formats(args.format), device_memory=args.device_memory,
                    image_format=args.image_format, quality=args.quality, guidance_scale=args.guidance_scale,
                    max_sequence_length=args.max_sequence_length,
                    seed=args.seed, **_batches(args.per_device_batch),
                    batches_per_slice=args.batches_per_slice, devices_per_host=devices_per_host, fsdp=args.fsdp,
                    decode_batch=args.decode_batch,
                    save_latents=args.save_latents, prompt_field=args.prompt_field, dedupe=args.dedupe,
                    scores=parse_scores(args.score), clip_model=args.clip_model, aesthetic_head=args.aesthetic_head,
                    safety_checker=args.safety_checker, min_clip_similarity=args.min_clip_similarity,
                    min_aesthetic=args.min_aesthetic, drop_nsfw=args.drop_nsfw)


def settings_from_flags(tokens: list[str] | tuple[str, ...], tpu_check: bool = True) -> Settings:
    """The Settings that the settings flags ``tokens`` (``add_settings_flags`` and
    ``--devices-per-host``, as ``promptmill plan`` takes them) give: what a plan command
    (``pipeline.cloud.gke.settings_flags``) reads back as. A bad or unknown flag is a ValueError."""
    parser = _RaisingParser(prog="promptmill plan", add_help=False)
    add_settings_flags(parser)
    parser.add_argument("--devices-per-host", type=int, default=_DEFAULTS.devices_per_host)
    args = parser.parse_args(list(tokens))
    return settings_from_args(args, args.devices_per_host, tpu_check=tpu_check)


def add_date_flag(parser: argparse.ArgumentParser, doing: str | None = None) -> None:
    """``--date``: ``doing`` says what the command does with the dated run (None: it starts
    or resumes it)."""
    then = doing or "a scheduled run re-triggered for the same date resumes it"
    parser.add_argument("--date", help=f"the run's scheduled date (YYYY-MM-DD or an RFC 3339 time), put in place of "
                        f"{{date}} in --out: {then}")


def add_gallery_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of what collect writes (the gallery, the metadata's parts), for every
    command that collects (``collect``, ``run``)."""
    from pipeline.collect.gallery import ORDERS, PAGE_SIZE, SAMPLE_SIZE
    from pipeline.collect.parts import PART_ROWS

    parser.add_argument("--gallery-page-size", type=int, default=PAGE_SIZE,
                        help="thumbnails per page of dataset/index.html and dataset/gallery/ (default: %(default)s)")
    parser.add_argument("--gallery-max", type=int, default=None, metavar="N",
                        help=f"show N images in the gallery, an even sample of the plan's positions (the same on "
                             f"every collect) (default: {SAMPLE_SIZE}, or every image of a smaller run)")
    parser.add_argument("--gallery-order", choices=ORDERS, default="position",
                        help="the gallery's order: plan order (position), or a score's, highest first (the "
                             "--gallery-max highest) (default: %(default)s)")
    parser.add_argument("--part-rows", type=int, default=PART_ROWS, metavar="N",
                        help="images of each part of the metadata, dataset/metadata/part-NNNNN.parquet, about: each "
                             "part holds whole slices (default: %(default)s)")


def gallery_of(args: argparse.Namespace) -> dict:
    """The flags of ``add_gallery_flags`` as ``run_collect``'s keywords."""
    return dict(page_size=args.gallery_page_size, gallery_max=args.gallery_max, gallery_order=args.gallery_order,
                part_rows=args.part_rows)


def add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="delete what an earlier run wrote under --out and start over (without it, re-running "
                             "the same settings resumes, and other settings are refused)")


def add_compile_cache_flag(parser: argparse.ArgumentParser, local_default: bool = False) -> None:
    """``--compile-cache``; with ``local_default`` (``run``), also ``--no-compile-cache``,
    since local runs use a cache under the promptmill cache folder unless told not to."""
    default = " (default for local pod runs: compile-cache/local under $PROMPTMILL_CACHE)" if local_default else ""
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="compilation cache folder (local or gs://): every host (or beam engine worker) loads "
                             "its compiled sampler from it instead of compiling when it is there; not part of the "
                             "run's settings" + default)
    if local_default:
        parser.add_argument("--no-compile-cache", action="store_true",
                            help="compile every program afresh, with no compilation cache")
