"""Output names (pure functions): keys from ids, and every object path under OUT.

Ids are never trusted as file names. A key is built only from ``[A-Za-z0-9_-]``, so
it cannot leave the output prefix, holds no dots (WebDataset splits keys at dots), and
stays short. Keys are unique because:
  * an id that is already safe (``SAFE_ID``, no ``--``) is its own stem;
  * a record without an id, whose id is its file's path (relative to the input root) and
    line, ``FILE:LINE``, is named by its file's label and line, ``label--LLINE``
    (``readable_stem``): labels are unique per
    run (``file_labels``) and hold no ``--``, and a line is digits after an ``L``;
  * any other id becomes ``slug--hash`` (slug of the id, ``--``, 16 lowercase hex of
    sha256), which no readable stem is (an ``L`` is not hex), and a safe stem never
    contains ``--``;
  * the key is ``stem_NNNN`` with a fixed-width image index.
Ids are unique per run (the plan rejects a repeated one), and a key is a function of its
id alone, so an id given by hand that spells another record's ``FILE:LINE`` is that
record's repeat, rejected, never a second record with its name.
"""
from __future__ import annotations

import dataclasses
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


def output_key(record_id: str, image_index: int, labels: dict[str, str] | None = None) -> str:
    """The key of one image of a record. ``labels`` ({file's relative path: label},
    ``file_labels``): an id ``FILE:LINE`` of
    one of those files is named ``readable_stem``; every other id ``key_stem``."""
    if not 0 <= image_index < MAX_IMAGES_PER_RECORD:
        raise ValueError(f"image_index must be in [0, {MAX_IMAGES_PER_RECORD}), got {image_index}")
    stem = None
    if labels:
        source, colon, line = record_id.rpartition(":")
        if colon and source in labels and line.isdigit() and line == str(int(line)):
            stem = readable_stem(labels[source], int(line))
    return f"{stem or key_stem(record_id)}_{image_index:04d}"


def readable_stem(label: str, line: int) -> str:
    """The stem of the record without an id on ``line`` of the file labelled ``label``."""
    return f"{label}--L{line}"


_FORMAT_SUFFIX = re.compile(r"(\.(jsonl|json|csv|tsv|txt|parquet))?(\.gz)?$", re.IGNORECASE)


def _slug(text: str) -> str:
    """``text`` in ``[A-Za-z0-9_-]``, at most 40 characters, no ``--``; accented letters
    without their accents (``café``: ``cafe``), other characters a ``-``."""
    import unicodedata

    folded = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    return _UNSAFE.sub("-", folded).strip("-")[:40].strip("-")


def file_labels(relatives) -> dict[str, str]:
    """{relative path: label} for the prompt files of a run (their paths relative to the
    input root, as auto ids spell them): each label is the slug of the path without its
    format's extension (``prompts/part-1.jsonl.gz``: ``prompts-part-1``); where two files
    would share one (``a.txt`` and ``a.jsonl``; ``x-y/p.txt`` and ``x/y-p.txt``), the
    slug of the whole path, then that and 8 hex of the path's sha256. Labels are unique,
    hold no ``--``, and depend only on the set of paths (pure)."""
    import collections

    paths = sorted(set(relatives))
    labels = {r: _slug(_FORMAT_SUFFIX.sub("", r)) or "file" for r in paths}
    for widen in (lambda r, label: _slug(r) or "file",
                  lambda r, label: f"{label}-{hashlib.sha256(r.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"):
        counts = collections.Counter(labels.values())
        labels = {r: widen(r, label) if counts[label] > 1 else label for r, label in labels.items()}
    if len(set(labels.values())) != len(labels):  # 8 hex of two paths' sha256 alike: never seen
        raise ValueError("two prompt files' labels collide; name the files apart")
    return labels


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', for local paths and gs:// URLs alike."""
    path = base.rstrip("/")
    for part in parts:
        path = f"{path}/{part.strip('/')}"
    return path


# Everything promptmill writes under OUT, by name relative to OUT, is given by a function of
# this module registered with the pattern of the names it gives (``writes``), or by a ``Fixed``
# name or a ``PerSlice`` object, which spell their own pattern; ``owned`` matches exactly those, and ``--overwrite`` deletes
# exactly the objects it matches, never another (a user's own file in OUT is kept).
# tests/core/test_naming.py calls every path function here and holds each name it gives against
# ``owned``, so a writer cannot give a name the rule misses.
WRITERS: dict[str, str] = {}  # {function name: the pattern of the names under OUT it gives}
_SIZE_GROUP = r"(\d+x\d+/)?"  # a run of several sizes keeps a zarr group per size


def writes(pattern: str):
    """Register a path function's names under OUT (a folder's: everything under it)."""
    def register(function):
        WRITERS[function.__name__] = pattern
        return function
    return register


_SPREAD = r"[0-9a-f]{4}-\d{5,}"  # ``output_name``
# The names of the earlier output layout (1): a run of it is refused, never read or written,
# but --overwrite still clears it (its objects are promptmill's).
_EARLIER = (r"shards/\d{5,}(\.tar|\.parquet|_stats\.json)", r"images/\d{5,}/[A-Za-z0-9_-]+\.(png|jpg|webp)",
            r"images/metadata\.jsonl", r"thumbs/\d{5,}/[A-Za-z0-9_-]+\.jpg", r"parquet/\d{5,}\.parquet",
            r"dataset/metadata\.parquet")


@dataclasses.dataclass(frozen=True)
class Fixed:
    """The path function of the one object of a fixed ``name`` under OUT, called as the others
    are (``naming.manifest(out)``). The name is spelled once: it is its own pattern (``owned``)."""
    name: str  # relative to OUT

    def __call__(self, out: str) -> str:
        return join(out, self.name)


@dataclasses.dataclass(frozen=True)
class PerSlice:
    """The path function of one whole object of each slice under OUT, called as the others are
    (``naming.shard_tar(out, index)``): ``FOLDER/NAME+SUFFIX``, NAME the slice's spread name
    (``output_name``). Its pattern follows from the folder and the suffix (``owned``)."""
    folder: str
    suffix: str

    def __call__(self, out: str, index: int) -> str:
        return join(out, self.folder, f"{output_name(index)}{self.suffix}")

    @property
    def pattern(self) -> str:
        return rf"{re.escape(self.folder)}/{_SPREAD}{re.escape(self.suffix)}"


def owned(name: str) -> bool:
    """Whether promptmill writes an object of this name (relative to OUT)."""
    global _OWNED
    if _OWNED is None:
        spelled = [re.escape(value.name) if isinstance(value, Fixed) else value.pattern
                   for value in globals().values() if isinstance(value, (Fixed, PerSlice))]
        _OWNED = re.compile("|".join(f"(?:{pattern})" for pattern in [*WRITERS.values(), *spelled, *_EARLIER,
                                                                       _TEMP]))
    return _OWNED.fullmatch(name) is not None


_OWNED: re.Pattern | None = None
_TEMP = r"(.+/)?\.promptmill-tmp-[^/]+"  # a local file being written (``TEMP_PREFIX``), or left by a kill


TEMP_PREFIX = ".promptmill-tmp-"  # a local file being written, renamed to its name once whole

# The output layout this version writes and reads (run.json's ``layout``): 2 puts each slice's
# outputs under spread names (``output_name``), packs its thumbnails, and writes the dataset in
# parts with a key index. A run of another layout is refused (``pipeline.io.runs``), never mixed.
LAYOUT = 2


def slice_name(index: int) -> str:
    return f"{index:05d}"


# The objects of one fixed name under OUT (``Fixed``):
run_json = Fixed("run.json")
# what the run's images are made in: libraries, XLA flags, platform (``pipeline.generate.environment``)
environment = Fixed("environment.json")
lease = Fixed("lease.json")  # the lease of the command that writes OUT now (``pipeline.io.lease``)
manifest = Fixed("plan/manifest.json")
# the input table: every prompt file the plan read, with its size and checksum
plan_inputs = Fixed("plan/inputs.json")
# the local prompt files' checksums by size and modification time, so that a resume reads only a
# file that changed (``pipeline.plan.input_table``)
input_cache = Fixed("plan/input_cache.json")
# the checkpoint's file table (sizes and sha256) the plan was made with
model_files = Fixed("plan/model_files.json")
# the dataset card, ``OUT/README.md``: where Hugging Face readers look for it
# (``datasets.load_dataset(OUT)`` reads its ``configs``)
dataset_card = Fixed("README.md")


@writes(r"plan/slices/\d{5,}\.jsonl")
def plan_slice(out: str, index: int) -> str:
    return join(out, "plan", "slices", f"{slice_name(index)}.jsonl")


@writes(r"plan/parts/\d{5,}-\d{12,}\.jsonl")
def plan_part(out: str, index: int, first_position: int) -> str:
    """A piece of a slice that several input files share, from the file holding
    ``first_position``; plan joins the pieces into the slice and deletes them."""
    return join(out, "plan", "parts", f"{slice_name(index)}-{first_position:012d}.jsonl")


@writes(r"plan/scans/[A-Za-z0-9_-]+\.npz")
def plan_scan(out: str, source: str) -> str:
    """The first pass's arrays for one input file (``plan.FileScan``); deleted once read."""
    return join(out, "plan", "scans", f"{key_stem(source)}.npz")


@writes(r"plan/scans/[A-Za-z0-9_-]+\.(ids|prompts|drops|keys)")
def plan_section(out: str, source: str, kind: str) -> str:
    """One input file's ``kind``: "ids" or "prompts", its id or prompt hashes sorted by hash
    (``pipeline.plan.duplicates``), deleted with its scan; "drops", its rows the duplicate
    checks reject, for its placing step; "keys", its planned keys by bucket, for the key
    index (``pipeline.plan.index``); both deleted once the key index is written."""
    return join(out, "plan", "scans", f"{key_stem(source)}.{kind}")


@writes(r"plan/scans/(ids|prompts)-\d{5,}\.range")
def plan_range(out: str, kind: str, hash_range: int) -> str:
    """What one hash range's id or prompt check found (``pipeline.plan.first_pass``): the
    rows it rejects, by file, and (ids) the rows the prompt check leaves out; deleted
    once the plan's key index is written."""
    return join(out, "plan", "scans", f"{kind}-{hash_range:05d}.range")


@writes(r"plan/rejects/[A-Za-z0-9_-]+\.jsonl")
def rejects_dir(out: str) -> str:
    return join(out, "plan", "rejects")


@writes(r"plan/rejects/[A-Za-z0-9_-]+\.jsonl")
def rejects_file(out: str, source: str) -> str:
    """The rejects file of one input source (named safely after it)."""
    return join(rejects_dir(out), f"{key_stem(source)}.jsonl")


def output_name(index: int) -> str:
    """The name of slice ``index``'s outputs (``3fa1-00042``): a short hash of the index
    before it, so that objects written slice after slice spread over the key space instead
    of landing on one range (GCS's request-rate guidance: a sequential prefix concentrates
    load on one server); the number after it keeps the name readable (pure)."""
    return f"{hashlib.sha256(str(index).encode()).hexdigest()[:4]}-{slice_name(index)}"


# The slice's whole objects (``PerSlice``):
shard_metadata = PerSlice("shards", ".parquet")  # one metadata row per image
shard_stats = PerSlice("shards", "_stats.json")  # the commit marker of a slice: written last
shard_tar = PerSlice("shards", ".tar")  # the WebDataset shard
image_parquet = PerSlice("parquet", ".parquet")  # the rows with image bytes (the ``parquet`` format)
# the gallery's thumbnails: one tar of ``KEY.jpg`` that the host writes with the other whole objects
thumb_pack = PerSlice("thumbs", ".tar")
_MARKER = re.compile(r"[0-9a-f]{4}-(\d{5,})_stats\.json")


def marker_slice(path: str) -> int | None:
    """The slice whose commit marker ``path`` names (``shard_stats``), else None."""
    name = path.rsplit("/", 1)[-1]
    match = _MARKER.fullmatch(name)
    if not match or f"{output_name(int(match.group(1)))}{shard_stats.suffix}" != name:
        return None
    return int(match.group(1))


@writes(r"zarr/(\d+x\d+/)?(zarr\.json|(images|latents|dropped|key)/.+)")
def zarr_group(out: str, group: str = "") -> str:
    """``OUT/zarr``, or a size's group in it (``OUT/zarr/832x1216``) in a run of several sizes."""
    return join(out, "zarr", group) if group else join(out, "zarr")


@writes(r"zarr/(\d+x\d+/)?images/.+")
def zarr_images(out: str, group: str = "") -> str:
    return join(zarr_group(out, group), "images")


@writes(r"zarr/(\d+x\d+/)?latents/.+")
def zarr_latents(out: str, group: str = "") -> str:
    """``--save-latents``: the final latents, indexed by position like ``zarr_images``."""
    return join(zarr_group(out, group), "latents")


@writes(rf"images/{_SPREAD}/[A-Za-z0-9_-]+\.(png|jpg|webp)")
def images_dir(out: str, index: int) -> str:
    """The folder of slice ``index``'s image files (``--format files``) and their metadata."""
    return join(out, "images", output_name(index))


@writes(rf"images/{_SPREAD}/[A-Za-z0-9_-]+\.(png|jpg|webp)")
def image_name(index: int, key: str, ext: str = "png") -> str:
    """An image file's name relative to OUT (the metadata's ``path``)."""
    return f"images/{output_name(index)}/{key}.{ext}"


@writes(r"dataset/(stats\.json|index\.html|gallery/page-\d{5,}\.html)")
def dataset_file(out: str, name: str) -> str:
    return join(out, "dataset", name)


# A YAML comment in the card's front matter (``pipeline.collect.card``): an OUT/README.md
# holding it is promptmill's to rewrite (collect) and delete (--overwrite); one without is a user's
CARD_MARKER = "# promptmill dataset card: written by promptmill collect, which rewrites it"


def is_our_card(text: str) -> bool:
    """Whether an ``OUT/README.md`` holding ``text`` is a card collect wrote (``CARD_MARKER``
    in its front matter)."""
    return CARD_MARKER in text.split("\n---", 1)[0].split("\n")


@writes(rf"images/{_SPREAD}/metadata\.jsonl")
def images_metadata(out: str, index: int) -> str:
    """``OUT/images/SLICE/metadata.jsonl``: a line per image file of slice ``index``, for the
    ``imagefolder`` builder (which reads a metadata file in each folder)."""
    return join(images_dir(out, index), "metadata.jsonl")


@writes(r"dataset/metadata/part-\d{5,}\.parquet")
def dataset_part(out: str, part: int) -> str:
    """A part of the dataset's metadata, ``OUT/dataset/metadata/part-NNNNN.parquet``: the rows
    of a contiguous range of slices (``pipeline.collect.parts``)."""
    return join(out, "dataset", "metadata", f"part-{part:05d}.parquet")


@writes(r"dataset/index/\d{5,}\.parquet")
def dataset_index(out: str, bucket: int) -> str:
    """A bucket of the dataset's key index: key -> part, row group, row (``pipeline.output.key_index``)."""
    return join(out, "dataset", "index", f"{bucket:05d}.parquet")


@writes(r"plan/keys/\d{5,}\.parquet")
def plan_keys(out: str, bucket: int) -> str:
    """A bucket of the plan's key index: key -> slice, position (``pipeline.output.key_index``)."""
    return join(out, "plan", "keys", f"{bucket:05d}.parquet")


@writes(r"logs/(attempt-\d+/)?(host-\d+\.log|hosts\.json)")
def logs_dir(out: str) -> str:
    """``OUT/logs``: a local run's host logs (``host_log``) and its ``hosts.json``, an earlier
    attempt's kept under ``attempt-K/`` (``attempt_logs``)."""
    return join(out, "logs")


def host_log(logs: str, host: int) -> str:
    """Host ``host``'s log in a logs folder (``logs_dir``, or an attempt's)."""
    return join(logs, f"host-{host}.log")


def attempt_logs(logs: str, attempt: int) -> str:
    """Where attempt ``attempt`` (from 1) of a run's host logs is kept once a later one starts."""
    return join(logs, f"attempt-{attempt}")


@writes(r"progress/host-\d{5,}\.json")
def progress_dir(out: str) -> str:
    """The hosts' progress objects, which ``promptmill status`` lists and reads."""
    return join(out, "progress")


def progress_name(host: int) -> str:
    """The progress object's name of pod host ``host``."""
    return f"host-{host:05d}"


@writes(r"progress/host-\d{5,}\.json")
def progress_file(out: str, name: str) -> str:
    """One host's progress object (``name``: ``progress_name``), rewritten while it runs."""
    return join(progress_dir(out), f"{name}.json")


@writes(r"ledger/host-\d{5,}\.json")
def ledger_dir(out: str) -> str:
    """The hosts' ledgers of their committed slices (``pipeline.io.ledgers``)."""
    return join(out, "ledger")


@writes(r"ledger/host-\d{5,}\.json")
def ledger_file(out: str, host: int) -> str:
    """Pod host ``host``'s ledger, written whole after each of its commits."""
    return join(ledger_dir(out), f"host-{host:05d}.json")
