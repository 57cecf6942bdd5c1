"""Output names (pure functions): keys from ids, and every object path under OUT.

Ids are never trusted as file names. A key is built only from ``[A-Za-z0-9_-]``, so
it cannot leave the output prefix, holds no dots (WebDataset splits keys at dots), and
stays short. Keys are unique because:
  * an id that is already safe (``SAFE_ID``, no ``--``) is its own stem;
  * any other id becomes ``slug--hash`` (slug of the id, ``--``, 16 hex of sha256), and
    a safe stem never contains ``--``;
  * the key is ``stem_NNNN`` with a fixed-width image index.
"""
from __future__ import annotations

import hashlib
import re

SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MAX_IMAGES_PER_RECORD = 10_000  # image indices are written with 4 digits
_UNSAFE = re.compile(r"[^A-Za-z0-9_]+")


def key_stem(record_id: str) -> str:
    """A file-name-safe stem that is unique per id."""
    if SAFE_ID.fullmatch(record_id) and "--" not in record_id:
        return record_id
    slug = _UNSAFE.sub("-", record_id).strip("-")[:40].strip("-")
    digest = hashlib.sha256(record_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{slug}--{digest}" if slug else f"id--{digest}"


def output_key(record_id: str, image_index: int) -> str:
    """The key of one image of a record."""
    if not 0 <= image_index < MAX_IMAGES_PER_RECORD:
        raise ValueError(f"image_index must be in [0, {MAX_IMAGES_PER_RECORD}), got {image_index}")
    return f"{key_stem(record_id)}_{image_index:04d}"


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', for local paths and gs:// URLs alike."""
    path = base.rstrip("/")
    for part in parts:
        path = f"{path}/{part.strip('/')}"
    return path


# Everything promptmill writes under OUT, by name relative to OUT; ``--overwrite`` deletes
# exactly the objects these match, never another (a user's own file in OUT is kept). An output
# added later joins this list: a test holds every object of a run with every output to it.
OWNED = re.compile(r"""(?x)
    run\.json
  | README\.md
  | plan/(manifest|model_files|inputs)\.json
  | plan/(slices|parts|rejects|scans)/[^/]+\.(jsonl|npz)
  | shards/\d{5,}(\.tar|\.parquet|_stats\.json)
  | images/\d{5,}/[A-Za-z0-9_-]+\.(png|jpg|webp)
  | images/metadata\.jsonl
  | thumbs/\d{5,}/[A-Za-z0-9_-]+\.jpg
  | parquet/\d{5,}\.parquet
  | zarr/zarr\.json
  | zarr/(images|latents|dropped|key)/.+
  | dataset/(metadata\.parquet|stats\.json|README\.md|index\.html|gallery/page-\d{5,}\.html)
  | logs/host-\d+(\.attempt-\d+)?\.log
  | logs/hosts\.json
  | progress/host-\d{5,}\.json
  | (.+/)?\.promptmill-tmp-[^/]+
""")


def owned(name: str) -> bool:
    """Whether promptmill writes an object of this name (relative to OUT)."""
    return OWNED.fullmatch(name) is not None


TEMP_PREFIX = ".promptmill-tmp-"  # a local file being written, renamed to its name once whole


def slice_name(index: int) -> str:
    return f"{index:05d}"


def run_json(out: str) -> str:
    return join(out, "run.json")


def manifest(out: str) -> str:
    return join(out, "plan", "manifest.json")


def plan_inputs(out: str) -> str:
    """The input table: every prompt file the plan read, with its size and checksum."""
    return join(out, "plan", "inputs.json")


def model_files(out: str) -> str:
    """The checkpoint's file table (sizes and sha256) the plan was made with."""
    return join(out, "plan", "model_files.json")


def plan_slice(out: str, index: int) -> str:
    return join(out, "plan", "slices", f"{slice_name(index)}.jsonl")


def plan_part(out: str, index: int, first_position: int) -> str:
    """A piece of a slice that several input files share, from the file holding
    ``first_position``; plan joins the pieces into the slice and deletes them."""
    return join(out, "plan", "parts", f"{slice_name(index)}-{first_position:012d}.jsonl")


def plan_scan(out: str, source: str) -> str:
    """The first pass's arrays for one input file (``plan.FileScan``); deleted once read."""
    return join(out, "plan", "scans", f"{key_stem(source)}.npz")


def rejects_dir(out: str) -> str:
    return join(out, "plan", "rejects")


def rejects_file(out: str, source: str) -> str:
    """The rejects file of one input source (named safely after it)."""
    return join(rejects_dir(out), f"{key_stem(source)}.jsonl")


def shard_metadata(out: str, index: int) -> str:
    return join(out, "shards", f"{slice_name(index)}.parquet")


def shard_stats(out: str, index: int) -> str:
    """The commit marker of a slice: written last."""
    return join(out, "shards", f"{slice_name(index)}_stats.json")


_MARKER = re.compile(r"(\d{5,})_stats\.json")


def marker_slice(path: str) -> int | None:
    """The slice whose commit marker ``path`` names (``shard_stats``), else None."""
    match = _MARKER.fullmatch(path.rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def shard_tar(out: str, index: int) -> str:
    """The slice's WebDataset shard."""
    return join(out, "shards", f"{slice_name(index)}.tar")


def image_parquet(out: str, index: int) -> str:
    """The slice's rows with image bytes (the ``parquet`` format)."""
    return join(out, "parquet", f"{slice_name(index)}.parquet")


def zarr_images(out: str) -> str:
    return join(out, "zarr", "images")


def zarr_latents(out: str) -> str:
    """``--save-latents``: the final latents, indexed by position like ``zarr_images``."""
    return join(out, "zarr", "latents")


def image_file(out: str, index: int, key: str, ext: str = "png") -> str:
    return join(out, "images", slice_name(index), f"{key}.{ext}")


def thumb_name(index: int, key: str) -> str:
    """The gallery thumbnail of ``key`` in slice ``index``, relative to OUT: a JPEG that the
    host writes with the image, in the slice's commit (``thumb_file``)."""
    return f"thumbs/{slice_name(index)}/{key}.jpg"


def thumb_file(out: str, index: int, key: str) -> str:
    return join(out, thumb_name(index, key))


def thumbs_dir(out: str, index: int) -> str:
    """The folder of slice ``index``'s thumbnails, listed by collect."""
    return join(out, "thumbs", slice_name(index))


def dataset_file(out: str, name: str) -> str:
    return join(out, "dataset", name)


def dataset_card(out: str) -> str:
    """The dataset card, ``OUT/README.md``: where Hugging Face readers look for it
    (``datasets.load_dataset(OUT)`` reads its ``configs``)."""
    return join(out, "README.md")


# A YAML comment in the card's front matter (``pipeline.collect.card``): an OUT/README.md
# holding it is promptmill's to rewrite (collect) and delete (--overwrite); one without is a user's
CARD_MARKER = "# promptmill dataset card: written by promptmill collect, which rewrites it"


def is_our_card(text: str) -> bool:
    """Whether an ``OUT/README.md`` holding ``text`` is a card collect wrote (``CARD_MARKER``
    in its front matter)."""
    return CARD_MARKER in text.split("\n---", 1)[0].split("\n")


def images_metadata(out: str) -> str:
    """``OUT/images/metadata.jsonl``: one line per image file, for the ``imagefolder`` builder."""
    return join(out, "images", "metadata.jsonl")


def progress_dir(out: str) -> str:
    """The hosts' progress objects, which ``promptmill status`` lists and reads."""
    return join(out, "progress")


def progress_name(host: int) -> str:
    """The progress object's name of pod host ``host``."""
    return f"host-{host:05d}"


def progress_file(out: str, name: str) -> str:
    """One host's progress object (``name``: ``progress_name``), rewritten while it runs."""
    return join(progress_dir(out), f"{name}.json")
