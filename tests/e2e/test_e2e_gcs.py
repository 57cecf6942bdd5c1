"""End to end on gs:// (the emulator): every format, hostile ids, and a run through a
proxy that fails about 10% of requests, which must give the same dataset."""
import hashlib
import io
import json
import os
import re
import tarfile

import numpy as np
import pytest
from PIL import Image

from pipeline.collect import parts
from pipeline.core import naming
from pipeline.io import gcs, storage
from pipeline.output import formats, writer
from pipeline.testing import emulator
from pipeline.testing.fault_proxy import FaultyProxy
from tests import trees
from tests.conftest import run_cli
from tests.e2e.test_e2e import STEPS, run_args, write_prompts

# Each case is a record whose id is hostile; the prompt names the case.
HOSTILE_IDS = {
    "parent": "../../x", "slash": "a/b", "empty": "", "long": "x" * 10_000, "unicode": "ünïcödé 🎨 画像",
    "control": "tab\there\x00nul\nnewline\x7fdel\x1b[31m", "dots": "a.b.c", "absolute": "/etc/passwd",
}
FORMATS = "files,webdataset,parquet,zarr"
IMAGES = 11 + len(HOSTILE_IDS)


@pytest.fixture(scope="module")
def gcs_inputs(gcs_emulator, tmp_path_factory, model_cache):
    """Prompts (9 ordinary records, one with 3 images, and the hostile ids) and the tiny model, on gs://."""
    from pipeline.model import load as model_lib
    from tests.model.test_model_sources import upload_tree

    local = tmp_path_factory.mktemp("gcs-prompts")
    write_prompts(local, 9)
    hostile = [json.dumps({"id": record_id, "prompt": f"hostile id case {case}"}, ensure_ascii=False)
               for case, record_id in HOSTILE_IDS.items()]
    (local / "part-2.jsonl").write_text("\n".join(hostile) + "\n", encoding="utf-8")
    for path in storage.glob(str(local / "*.jsonl")):
        storage.write_bytes(f"gs://{gcs_emulator}/prompts/{os.path.basename(path)}", storage.read_bytes(path))
    model = f"gs://{gcs_emulator}/models/tiny-e2e"
    upload_tree(model_lib.resolve("tiny"), model)
    return f"gs://{gcs_emulator}/prompts/*.jsonl", model


def gcs_run(inputs, out, cache, env=None):
    prompts, model = inputs
    args = run_args(prompts, out, 2, 2, "--format", FORMATS)
    args[args.index("--model") + 1] = model
    return run_cli(args, cache, env=env)


CREATED = {}  # what the clean run added to the bucket


@pytest.fixture(scope="module")
def clean_run(gcs_emulator, gcs_inputs, model_cache):
    out = f"gs://{gcs_emulator}/runs/clean"
    before = set(storage.glob(f"gs://{gcs_emulator}/**"))
    result = gcs_run(gcs_inputs, out, model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    CREATED[out] = sorted(set(storage.glob(f"gs://{gcs_emulator}/**")) - before)
    return out


def zarr_images(out: str):
    """``OUT/zarr/images`` of a gs:// run, read from a local copy of its objects (fetched with
    google-cloud-storage): tensorstore reads a sharded array with ranged reads that check
    the object's generation, which the emulator's ranged responses do not carry (GCS's do)."""
    import tempfile

    local = tempfile.mkdtemp()
    for path in storage.glob(naming.join(out, "zarr")):
        storage.write_bytes(naming.join(local, path[len(out) + 1:]), storage.read_bytes(path))
    return formats.read_zarr_images(local)


def metadata(out):
    return parts.dataset_rows(out)


def test_all_formats_with_prompts_model_and_output_on_gcs(clean_run, gcs_inputs, tmp_path):
    import webdataset as wds

    out, model = clean_run, gcs_inputs[1]
    rows = metadata(out)
    assert {r["model"] for r in rows} == {model}
    assert len(rows) == IMAGES and storage.read_json(naming.dataset_file(out, "stats.json"))["verified"]
    pixels = {}
    for row in rows:
        data = storage.read_bytes(naming.join(out, row["path"]))
        assert hashlib.sha256(data).hexdigest() == row["sha256"]
        pixels[row["key"]] = np.asarray(Image.open(io.BytesIO(data)))
    manifest = storage.read_json(naming.manifest(out))
    seen_tar, seen_parquet = set(), set()
    for index in range(manifest["slices"]):
        tar_path = tmp_path / f"{index}.tar"
        tar_path.write_bytes(storage.read_bytes(naming.shard_tar(out, index)))
        for sample in wds.WebDataset(str(tar_path), shardshuffle=False):
            assert {"png", "json", "txt"} <= set(sample)
            key = sample["__key__"]
            assert json.loads(sample["json"])["key"] == key and sample["txt"].decode() == json.loads(sample["json"])["prompt"]
            np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(sample["png"]))), pixels[key])
            seen_tar.add(key)
        table = writer.parquet_table(storage.read_bytes(naming.image_parquet(out, index)))
        for record in table.to_pylist():
            np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(record["image"]["bytes"]))),
                                          pixels[record["key"]])
            seen_parquet.add(record["key"])
    assert seen_tar == seen_parquet == set(pixels)
    zarr = zarr_images(out)
    assert zarr.shape == (IMAGES, 32, 32, 3)
    for row in rows:
        np.testing.assert_array_equal(zarr[row["position"]].read().result(), pixels[row["key"]])


def test_every_object_the_run_wrote_is_one_overwrite_would_delete(clean_run):
    """naming.OWNED names every object of a run with every format (what --overwrite deletes)."""
    names = [path[len(clean_run) + 1:] for path in CREATED[clean_run] if path.startswith(clean_run + "/")]
    assert names and [name for name in names if not naming.owned(name)] == []


@pytest.mark.parametrize("case", list(HOSTILE_IDS))
def test_a_hostile_id_gets_a_safe_unique_key_inside_out(clean_run, case):
    out, record_id = clean_run, HOSTILE_IDS[case]
    rows = metadata(out)
    [row] = [r for r in rows if r["prompt"] == f"hostile id case {case}"]
    # the id is kept as given (an empty id means "no id": it gets the automatic source:line id)
    assert row["id"] == (record_id or f"part-2.jsonl:{list(HOSTILE_IDS).index(case) + 1}")
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,80}", row["key"]), row["key"]
    assert sum(r["key"] == row["key"] for r in rows) == 1
    # every object of the image sits under OUT, where the layout says
    image = naming.join(out, row["path"])
    assert row["path"] == naming.image_name(row["slice"], row["key"]) and storage.exists(image)
    with tarfile.open(fileobj=io.BytesIO(storage.read_bytes(naming.shard_tar(out, row["slice"])))) as tar:
        names = tar.getnames()
    assert {f"{row['key']}.png", f"{row['key']}.json", f"{row['key']}.txt"} <= set(names)
    # every object the run created anywhere in the bucket is under OUT, in the layout's folders
    created = CREATED[out]
    assert created and [o for o in created if not o.startswith(out + "/")] == []
    assert [o for o in created if not naming.owned(o[len(out) + 1:])] == []


def _normalized(out: str) -> dict:
    """Everything a reader sees in a run, minus the run's planning time (``created_at``)."""
    def strip(row):
        return {k: v for k, v in row.items() if k != "created_at"}

    manifest = storage.read_json(naming.manifest(out))
    files = trees.checksums(naming.join(out, "images"))
    # each slice's imagefolder metadata: rows with created_at
    jsonl = [naming.images_metadata(out, index) for index in range(manifest["slices"])]
    found = {"rows": sorted((strip(r) for r in metadata(out)), key=lambda r: r["key"]),
             "files": {name: sum_ for name, sum_ in files.items() if not name.endswith("metadata.jsonl")},
             "jsonl": [strip(json.loads(line)) for path in jsonl for line in storage.read_text(path).splitlines()],
             "tar": {}, "parquet": {}}
    for index in range(manifest["slices"]):
        with tarfile.open(fileobj=io.BytesIO(storage.read_bytes(naming.shard_tar(out, index)))) as tar:
            for member in tar.getmembers():
                data = tar.extractfile(member).read()
                found["tar"][member.name] = strip(json.loads(data)) if member.name.endswith(".json") else data
        table = writer.parquet_table(storage.read_bytes(naming.image_parquet(out, index)))
        for record in table.to_pylist():
            found["parquet"][record["key"]] = strip(record)
    found["zarr"] = zarr_images(out).read().result()
    return found


def test_a_run_through_a_faulty_proxy_gives_the_clean_runs_dataset(clean_run, gcs_emulator, gcs_inputs,
                                                                    model_cache):
    upstream = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    out = f"gs://{gcs_emulator}/runs/faulty"
    with FaultyProxy(upstream, failure_rate=0.1, seed=11) as proxy:
        # every client of every process (plan, hosts, collect, tensorstore) goes through the proxy
        env = dict(os.environ, **emulator.env_for(f"http://127.0.0.1:{proxy.port}"))
        result = gcs_run(gcs_inputs, out, model_cache, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    faults = {k: v for k, v in proxy.counts.items() if k != "forwarded"}
    assert min(faults.values()) >= 3, proxy.counts  # 503s, 429s and dropped connections all happened
    assert proxy.counts["forwarded"] > 100
    clean, faulty = _normalized(clean_run), _normalized(out)
    assert len(clean["rows"]) == IMAGES
    assert len(clean["jsonl"]) == IMAGES
    for part in ("rows", "files", "jsonl", "tar", "parquet"):
        assert faulty[part] == clean[part], part
    np.testing.assert_array_equal(faulty["zarr"], clean["zarr"])


def test_collect_reads_no_image_bytes(clean_run, gcs_emulator, model_cache):
    """Collect of a run in every format, with every GCS request watched by a proxy: it
    reads plan items, commit markers and metadata shards, and lists images and
    thumbnails, but downloads no byte of an image (files, tar, image parquet, zarr) or
    of a thumbnail."""
    from urllib.parse import unquote, urlsplit

    upstream = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    out = clean_run
    prefix = out[len(f"gs://{gcs_emulator}/"):] + "/"
    with FaultyProxy(upstream, failure_rate=0.0, own_links=True) as proxy:  # every download goes through it
        env = dict(os.environ, **emulator.env_for(f"http://127.0.0.1:{proxy.port}"))
        result = run_cli(["collect", "--out", out], model_cache, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    read: dict[str, int] = {}  # object under OUT -> bytes downloaded
    for method, path, size in proxy.requests:
        url = urlsplit(path)
        if method == "GET" and "alt=media" in url.query:
            name = unquote(url.path.split("/o/", 1)[1])
            assert name.startswith(prefix), name
            read[name[len(prefix):]] = read.get(name[len(prefix):], 0) + size
    slices = storage.read_json(naming.manifest(out))["slices"]
    # the proxy saw collect's reads: every slice's metadata shard and commit marker
    thumbnails = 0
    for index in range(slices):
        assert read[naming.shard_metadata(out, index)[len(out) + 1:]] > 0
        assert naming.shard_stats(out, index)[len(out) + 1:] in read
        index_of = storage.read_json(naming.shard_stats(out, index))["thumbnail_index"]
        thumbnails += sum(size for _, size in index_of.values())
    # (the zarr arrays' metadata is read, to consolidate it into OUT/zarr/zarr.json for xarray)
    images = {name: size for name, size in read.items()
              if (name.startswith(("images/", "thumbs/", "parquet/", "zarr/")) or name.endswith(".tar"))
              and not re.fullmatch(r"zarr/\w+/zarr\.json", name) and not name.startswith("thumbs/")}
    assert images == {}
    # the gallery's thumbnails are read one by one from the slices' packs: never a whole pack
    packs = {name: size for name, size in read.items() if name.startswith("thumbs/")}
    assert packs and sum(packs.values()) <= thumbnails
    # (and OUT/README.md, whose first lines say whether collect wrote it: a user's card is never replaced)
    allowed = re.compile(r"run\.json|plan/manifest\.json|plan/inputs\.json|plan/slices/\d{5}\.jsonl|plan/rejects/.+\.jsonl"
                         r"|plan/keys/\d{5}\.parquet|shards/[0-9a-f]{4}-\d{5}(\.parquet|_stats\.json)"
                         r"|thumbs/[0-9a-f]{4}-\d{5}\.tar|dataset/stats\.json|zarr/\w+/zarr\.json|README\.md|lease\.json|environment\.json")
    assert [name for name in read if not allowed.fullmatch(name)] == []
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["verified"] and stats["images"] == IMAGES
    assert '<img src="data:image/jpeg;base64,' in storage.read_text(naming.dataset_file(out, "index.html"))


def test_planning_a_gcs_model_downloads_no_weights_and_hosts_check_it_by_listing(gcs_emulator, gcs_inputs,
                                                                                model_cache, tmp_path):
    """A plan of a gs:// model, every GCS request watched by a proxy, on a machine whose
    cache does not hold the model: it downloads the configs (to describe the model) and
    no weights file; its fingerprint and file table are the objects' checksums. A host
    loading the model then checks it against that table without reading an object."""
    from pipeline.generate import runtime
    from pipeline.io import runs
    from pipeline.model.loading import identity
    from pipeline.model import load as model_load
    from tests.model.test_model_sources import downloads, watched

    prompts, model = gcs_inputs
    out = f"gs://{gcs_emulator}/runs/plan-only"
    args = ["plan", "--prompts", prompts, "--out", out, "--model", model, "--devices-per-host", "1", "--steps", STEPS,
            "--per-device-batch", "1", "--batches-per-slice", "2"]
    upstream = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    with FaultyProxy(upstream, failure_rate=0.0, own_links=True) as proxy:
        env = dict(os.environ, **emulator.env_for(f"http://127.0.0.1:{proxy.port}"))
        result = run_cli(args, str(tmp_path / "fresh-cache"), env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    fetched = downloads(proxy, model)
    assert "model_index.json" in fetched and "unet/config.json" in fetched
    assert [name for name in fetched if not name.endswith((".json", ".txt"))] == []
    listed = storage.object_checksums(model)
    assert storage.read_json(naming.model_files(out))["files"] == listed
    run = runs.read(out)
    assert run.model_fingerprint == identity.fingerprint(model) == identity.listing_fingerprint(listed)

    model_load.resolve(model)  # this machine's copy, as the host's load makes it before checking
    with watched() as proxy:
        loaded = runtime.load_model(run, out)
    assert loaded.fingerprint == run.model_fingerprint
    assert downloads(proxy, model) == {}


def test_status_of_a_gcs_run_reads_no_image_and_no_metadata_shard(clean_run, gcs_emulator):
    """``promptmill status`` of the finished gs:// run, every GCS request watched by a
    proxy: the hosts' progress objects and ledgers are there, and it downloads run.json,
    the manifest, those objects and collect's stats, and nothing else; it counts the
    committed slices from the ledgers, and lists no commit marker."""
    from urllib.parse import unquote, urlsplit

    from pipeline.collect import status

    upstream = os.environ["STORAGE_EMULATOR_HOST"]
    out = clean_run
    prefix = out[len(f"gs://{gcs_emulator}/"):] + "/"
    with FaultyProxy(int(upstream.rsplit(":", 1)[1]), failure_rate=0.0, own_links=True) as proxy:
        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{proxy.port}"
        gcs.reset_client()
        try:
            report = status.status(out)
        finally:
            os.environ["STORAGE_EMULATOR_HOST"] = upstream
            gcs.reset_client()
    slices = storage.read_json(naming.manifest(out))["slices"]
    assert report["state"] == "collected" and report["collect"]["verified"]
    assert (report["committed"]["slices"], report["committed"]["images"]) == (slices, IMAGES)
    assert [(h["host"], h["state"]) for h in report["hosts"]] == [(0, "done"), (1, "done")]
    assert sum(h["images"] for h in report["hosts"]) == IMAGES
    downloaded = sorted(unquote(urlsplit(path).path.split("/o/", 1)[1])[len(prefix):]
                        for method, path, _ in proxy.requests if method == "GET" and "alt=media" in path)
    assert downloaded == ["dataset/stats.json", "ledger/host-00000.json", "ledger/host-00001.json",
                          "plan/manifest.json", "progress/host-00000.json", "progress/host-00001.json", "run.json"]
    assert report["committed"]["counted_from"] == "ledgers"
    assert not [path for method, path, _ in proxy.requests if "shards" in unquote(path) and "alt=media" not in path
                and "/o?" in path]  # no listing of the markers (checking two of them is no listing)
    assert len(proxy.requests) < 25  # a handful of requests a host, whatever the run's size
