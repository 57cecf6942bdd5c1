"""Aspect-ratio buckets: several sizes in one run (``--sizes``).

Pure rules (``pipeline.core.buckets``), records asking for a size, the plan's layout per
size under Beam, and a real 2x2 run of tiny with three sizes whose every image is the
bytes a single-size run of its size makes. (tiny-flux's three-size run is test_flux.py's
sharded 1x4/2x2 run; a warm re-run of several sizes compiles none: test_compile_cache.py.)
"""
import hashlib
import json
import os
import re

import numpy as np
import pytest

from pipeline.collect import parts
from pipeline.core import buckets, logs, naming, records
from pipeline.core.settings import Settings
from pipeline.io import storage
from pipeline.output import writer
from tests import trees
from tests.conftest import run_cli
from tests.generate.test_tpu_check import _Shapes  # a model of no shapes, for the checks whose memory figures are faked

SIZES = ("32x32", "24x32", "32x24")  # square (the default), portrait, landscape


def test_sizes_parse_to_canonical_names_and_bad_ones_are_refused():
    assert buckets.parse_sizes("1024x1024, 832X1216,1216×832") == ("1024x1024", "832x1216", "1216x832")
    assert buckets.parse_sizes("common") == ("common",)
    for bad, message in (("1024", "WIDTHxHEIGHT"), ("64x64,64x64", "more than once"), ("", "got nothing")):
        with pytest.raises(ValueError, match=message):
            buckets.parse_sizes(bad)
    with pytest.raises(ValueError, match="--sizes must be a positive whole number of pixels, got 0"):
        Settings(sizes=("64x0",)).validate()
    with pytest.raises(ValueError, match="--sizes 64x64,64x48 and --width 48 --height 64: give one"):
        Settings(sizes=("64x64", "64x48"), width=48, height=64).validate()


def test_the_common_preset_is_scaled_to_the_native_area_and_rounded_to_the_multiple():
    assert buckets.preset_sizes(1024, 16)[:3] == ("1024x1024", "1152x896", "896x1152")
    assert len(buckets.preset_sizes(1024, 16)) == 9
    sd15 = buckets.preset_sizes(512, 8)  # 0.26 megapixels
    assert sd15 == ("512x512", "576x448", "448x576", "608x416", "416x608", "672x384", "384x672", "768x320", "320x768")
    for name in buckets.preset_sizes(768, 16):
        width, height = buckets.parse_size(name)
        assert width % 16 == height % 16 == 0 and 0.85 < width * height / 768 ** 2 < 1.15


@pytest.mark.parametrize("asked, expected", [
    ("3:4", 1), ("4:3", 2), ("1:1", 0), (0.74, 1), ("16/9", 2), (1.0, 0),
    (np.sqrt(0.75), 0),  # as near 24x32 as 32x32 by |log ratio|: the earlier size
])
def test_aspect_ratio_goes_to_the_nearest_size_ties_to_the_earlier(asked, expected):
    assert buckets.assign({"aspect_ratio": asked}, SIZES) == (expected, "aspect_ratio")


@pytest.mark.parametrize("row, reason", [
    ({"width": 40, "height": 40}, "size_not_a_bucket"), ({"width": 32}, "bad_size"),
    ({"width": "wide", "height": 32}, "bad_size"), ({"aspect_ratio": "x"}, "bad_aspect_ratio"),
    ({"aspect_ratio": -1}, "bad_aspect_ratio"), ({"aspect_ratio": "3:0"}, "bad_aspect_ratio"),
    ({"width": 24, "height": 32, "aspect_ratio": "4:3"}, "conflicting_size"),
])
def test_a_size_no_bucket_answers_is_rejected_with_its_reason(row, reason):
    rejected = records.parse_decoded({"prompt": "p", **row}, "f.jsonl", 3, 0, "f.jsonl:3", sizes=SIZES)
    assert isinstance(rejected, records.Reject) and rejected.reason == reason, rejected


def test_records_ask_for_a_size_only_when_the_run_declares_sizes():
    laion = {"prompt": "p", "width": 1000, "height": 667, "aspect_ratio": 1.5}
    plain = records.parse_decoded(laion, "f", 1, 0, "f:1")  # no --sizes: they pass through, as before
    assert plain.bucket == 0 and plain.extra == {"width": 1000, "height": 667, "aspect_ratio": 1.5}
    sized = records.parse_decoded({"prompt": "p", "width": "24", "height": 32.0}, "f", 1, 0, "f:1", sizes=SIZES)
    # a whole number is one however it is written: 32.0 and "32.0" alike
    assert records.parse_decoded({"prompt": "p", "width": "24.0", "height": "32"}, "f", 1, 0, "f:1",
                                 sizes=SIZES).bucket == sized.bucket
    assert sized.bucket == 1 and sized.extra == {}  # read, not passed through: the metadata has the size
    wide = records.parse_decoded({"prompt": "p", "aspect_ratio": "16:9"}, "f", 1, 0, "f:1", sizes=SIZES)
    assert wide.bucket == 2 and wide.extra == {"aspect_ratio": "16:9"}  # what was asked, beside the size given
    assert records.parse_decoded({"prompt": "p"}, "f", 1, 0, "f:1", sizes=SIZES).bucket == 0


def test_the_geometry_places_each_size_after_the_last_and_hosts_walk_sizes_in_step():
    geometry = buckets.Geometry.lay_out([(32, 32), (24, 32), (32, 24)], [2, 1, 3], [8, 4, 12], [9, 0, 13])
    assert [(b.offset, b.first_slice, b.slices) for b in geometry.buckets] == [(0, 0, 2), (9, 2, 0), (9, 2, 2)]
    assert geometry.slices == 4 and geometry.slice_span(1) == (8, 9) and geometry.slice_span(3) == (21, 22)
    assert [geometry.bucket_of_slice(i) for i in range(4)] == [0, 0, 2, 2]
    # a record's items are placed in the slices whose spans hold their positions
    record = records.parse_row({"prompt": "p", "num_images": 2}, "f", 1, 0, "f:1")
    items = records.expand(record, 20, 12, bucket_start=(9, 2))  # bucket 2: from position 9, slice 2
    assert [geometry.slice_span(item.slice)[0] <= item.position < geometry.slice_span(item.slice)[1]
            for item in items] == [True, True] and [item.slice for item in items] == [2, 3]
    manifest = {"buckets": [b.to_json() for b in geometry.buckets], "slice_size": 8, "images": 22, "slices": 4}
    assert [buckets.manifest_slice_images(manifest, i) for i in range(4)] == [8, 1, 12, 1]
    assert buckets.Geometry.of_manifest(json.loads(json.dumps(manifest)), 0, 0, 0) == geometry
    from pipeline.collect import status  # what status shows of each size, slices 0 and 2 committed

    from pipeline.io import ledgers

    committed = ledgers.from_times({0: 1.0, 2: 1.0}, manifest)
    assert [(r["size"], r["committed_slices"], r["slices"], r["committed_images"], r["images"], r["slice_size"])
            for r in status.size_progress(manifest, committed)] == [("32x32", 1, 2, 8, 9, 8), ("24x32", 0, 0, 0, 0, 4),
                                                                     ("32x24", 1, 2, 12, 13, 12)]
    one = {"slices": 3, "images": 9, "slice_size": 4}
    assert status.size_progress(one, ledgers.from_times({0: 1.0}, one)) == []  # one size: the totals say it all
    slots = {host: buckets.host_slots(host, 3, geometry) for host in range(3)}
    assert slots[0] == [(0, 0), (2, 2)] and slots[1] == [(0, 1), (2, 3)] and slots[2] == [(0, None), (2, None)]
    # the sizes each host makes programs for: not the size no record asked for, nor (resumed) one whose
    # slices of this host are all committed, unless it holds a padding slot of it
    assert [buckets.sizes_to_make(host, 3, geometry, {}) for host in range(3)] == [(0, 2)] * 3
    assert buckets.sizes_to_make(0, 3, geometry, {0: 1.0}) == (2,) and buckets.sizes_to_make(0, 3, geometry, {0, 2}) == ()
    assert buckets.sizes_to_make(2, 3, geometry, {0, 1, 2, 3}) == (0, 2)
    # one size: today's assignment
    single = buckets.Geometry.of_manifest({"slice_size": 4, "images": 10}, 8, 8, 1)
    assert [s for _, s in buckets.host_slots(1, 2, single)] == [1, None]


def test_the_plan_lays_out_each_size_under_beam_and_conserves_rows(tmp_path, model_cache):
    from pipeline.plan import transforms

    rows = [{"prompt": "a"}, {"prompt": "b", "width": 24, "height": 32}, {"prompt": "c", "aspect_ratio": "4:3",
                                                                          "num_images": 3},
            {"prompt": "d", "width": 40, "height": 40}, {"prompt": "e"}, {"prompt": "f", "aspect_ratio": 0.7}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "q.jsonl").write_text(json.dumps({"prompt": "g", "aspect_ratio": "4:3"}) + "\n")
    out = str(tmp_path / "out")
    manifest = transforms.run_plan(Settings(prompts=str(tmp_path / "*.jsonl"), out=out, model="tiny", sizes=SIZES,
                                            steps=1, batches_per_slice=2))
    assert manifest["records"] + manifest["rejects"] == manifest["input_rows"] == 7
    assert manifest["rejects_by_reason"] == {"size_not_a_bucket": 1}
    by_size = {b["size"]: (b["records"], b["images"], b["slices"], b["first_slice"]) for b in manifest["buckets"]}
    assert by_size == {"32x32": (2, 2, 1, 0), "24x32": (2, 2, 1, 1), "32x24": (2, 4, 2, 2)}
    slices = [[json.loads(line) for line in storage.read_text(naming.plan_slice(out, i)).splitlines()]
              for i in range(manifest["slices"])]
    assert [[(i["prompt"], i.get("bucket", 0)) for i in s] for s in slices] == [
        [("a", 0), ("e", 0)], [("b", 1), ("f", 1)], [("c", 2), ("c", 2)], [("c", 2), ("g", 2)]]  # g: another file
    assert [i["position"] for s in slices for i in s] == list(range(8))
    assert json.loads(storage.read_text(naming.run_json(out)))["settings"]["sizes"] == list(SIZES)


@pytest.fixture(scope="module")
def sized_run(tmp_path_factory, model_cache):
    """A 2x2 run of tiny with three sizes (records asking by width/height, by aspect_ratio
    and for nothing), files and zarr."""
    folder = tmp_path_factory.mktemp("sizes")
    rows = [{"prompt": "a square by default", "id": "square"},
            {"prompt": "a tall tower", "id": "tower", "width": 24, "height": 32, "num_images": 2},
            {"prompt": "a wide field", "id": "field", "aspect_ratio": "16:9"},
            {"prompt": "a portrait", "id": "face", "aspect_ratio": "3:4"},
            {"prompt": "no such size", "id": "odd", "width": 48, "height": 16},
            {"prompt": "another square", "id": "box", "seed": 3},
            {"prompt": "a long river", "id": "river", "aspect_ratio": 2}]
    (folder / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(folder / "sized")
    result = run_cli(sized_command(str(folder), out), model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def sized_command(folder: str, out: str) -> list[str]:
    """The ``promptmill run`` of ``sized_run``'s prompts in ``folder`` into ``out``, with the compile
    cache of its own in ``folder`` (the session's may hold a program of this run from another test)."""
    return ["run", "--prompts", os.path.join(folder, "p.jsonl"), "--out", out, "--sizes", ",".join(SIZES),
            "--hosts", "2", "--devices-per-host", "2", "--format", "files,zarr", "--compile-cache",
            os.path.join(folder, "compile-cache"), "--model", "tiny", "--steps", "1", "--per-device-batch", "1",
            "--batches-per-slice", "1", "--no-progress"]


def single_size_hashes(out: str, rows: dict, sizes: tuple[str, ...]) -> dict:
    """{key: sha256} of the image of each row of ``sizes`` made alone, one record per batch,
    by the program of a single-size run of its size (``--width W --height H``) on one device."""
    import jax

    from pipeline.generate import runtime
    from pipeline.io import runs

    run = runs.read(out)
    found, model, params = {}, None, None
    for size in sizes:
        width, height = buckets.parse_size(size)
        single = Settings(**{**run.settings.to_dict(), "sizes": (), "bucket_batches": (), "width": width,
                             "height": height, "formats": tuple(run.settings.formats),
                             "loras": (), "scores": ()}).validate()
        if model is None:
            model = runtime.load_model(run.with_settings(single))
        generator = runtime.make_generator(model, single, jax.local_devices()[:1], params=params)
        params = generator.params
        for key, row in rows.items():
            if (row["width"], row["height"]) == (width, height):
                [image] = generator(generator.batch_of([(row["prompt"], row["negative_prompt"],
                                                         row["guidance_scale"], row["seed"], row["image_index"])]))
                found[key] = hashlib.sha256(writer.formats.encode(image, "png")).hexdigest()
    return found


def _rows(out):
    return {r["key"]: r for r in parts.dataset_rows(out)}


def test_a_three_size_run_makes_each_image_at_its_size_as_a_single_size_run_does(sized_run):
    from PIL import Image

    out = sized_run
    rows = _rows(out)
    sizes = {key.split("--")[0].split("_")[0]: (r["width"], r["height"]) for key, r in rows.items()}
    assert sizes == {"square": (32, 32), "box": (32, 32), "tower": (24, 32), "face": (24, 32), "field": (32, 24),
                     "river": (32, 24)}
    for row in rows.values():
        with Image.open(naming.join(out, row["path"])) as image:
            assert image.size == (row["width"], row["height"])
    assert json.loads(rows["field_0000"]["extra"]) == {"aspect_ratio": "16:9"}  # asked; given: 32x24
    # the bytes of a single-size run of each size, with the same per-device batch: its program
    # (a generator of the single-size settings) makes each record alone (the portrait size's:
    # test_beam_workers_generate_each_size_with_its_own_program_as_the_pod_hosts_did)
    others = ("32x32", "32x24")
    assert single_size_hashes(out, rows, others) == {
        key: row["sha256"] for key, row in rows.items() if f"{row['width']}x{row['height']}" in others}
    assert len({r["sha256"] for r in rows.values()}) == 7
    # rows conserved: one rejected, with its reason
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["verified"] and stats["conservation"]["holds"] and stats["images"] == 7
    assert stats["rejects_by_reason"] == {"size_not_a_bucket": 1}
    [reject] = [json.loads(line) for path in storage.glob(naming.join(out, "plan", "rejects", "*"))
                for line in storage.read_text(path).splitlines()]
    assert reject["line"] == 5 and "48x16 is not one of the run's sizes (32x32, 24x32, 32x24)" in reject["message"]
    assert {size: c["images"] for size, c in stats["sizes"].items()} == {"32x32": 2, "24x32": 3, "32x24": 2}
    card = storage.read_text(naming.dataset_card(out))
    assert "| sizes (width x height; the first is the default) | `32x32, 24x32, 32x24` |" in card
    assert "| `24x32` | 2 | 3 | 3 | 0 | 1 |" in card
    gallery = storage.read_text(naming.dataset_file(out, "index.html"))
    assert 'width="96" height="128"' in gallery and 'width="128" height="96"' in gallery  # each in its own shape


def test_each_host_compiles_each_sizes_program_once(sized_run):
    out = sized_run
    events = [e for path in storage.glob(naming.join(out, "logs", "host-*.log"))
              for e in map(logs.parse, storage.read_text(path).splitlines()) if e]
    for host in (0, 1):
        mine = [e for e in events if e.get("host") == host]
        [ready] = [e for e in mine if e["event"] == "host_ready"]  # the first size's, while the weights loaded
        assert ready["sampler_compiles"] == 1
        made = [e for e in mine if e["event"] == "size_ready"]  # the later sizes', once each
        assert [e["size"] for e in made] == ["24x32", "32x24"] and all(e["sampler_compiles"] == 1 for e in made)
        [done] = [e for e in mine if e["event"] == "host_done"]
        assert done["sizes"] == 3 and done["size_compiles"] >= 2 and done["compiles_after_warmup"] == 0


def test_a_resumed_run_of_several_sizes_makes_what_is_left_starting_at_its_first_size_left(sized_run, tmp_path,
                                                                                              model_cache):
    """The three-size run as if stopped after its square size: the other sizes' commits gone,
    the same command resumes it. Each host starts with the programs of the first size it has
    work of (host 0: the portrait size; host 1 pads the square size's slice it has none of),
    never makes the square size's program on host 0, and the dataset is the uninterrupted
    run's, byte for byte. Its OUT's name holds glob characters, which no layer reads as a
    pattern. Every object of it, the kept logs and each size's zarr group included, is
    promptmill's by the ownership rule, and --overwrite then deletes all of them, but
    never follows nor deletes a link planted in OUT (a loop among them) and ends."""
    import shutil

    out = str(tmp_path / "resumed [o7]*?")
    shutil.copytree(sized_run, out)
    manifest = storage.read_json(naming.manifest(out))
    square = manifest["buckets"][0]
    assert square["size"] == "32x32" and square["slices"] == 1
    for index in range(square["first_slice"] + square["slices"], manifest["slices"]):
        os.remove(naming.shard_stats(out, index))  # not committed: a resumed run makes them again
    result = run_cli(sized_command(os.path.dirname(sized_run), out), model_cache)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["verified"]
    assert {k: r["sha256"] for k, r in _rows(out).items()} == {k: r["sha256"] for k, r in _rows(sized_run).items()}
    assert storage.exists(naming.join(out, "logs", "attempt-1", "host-0.log"))  # the first attempt's, kept
    host0 = [e for e in map(logs.parse, storage.read_text(naming.join(out, "logs", "host-0.log")).splitlines()) if e]
    [ready] = [e for e in host0 if e["event"] == "host_ready"]
    assert (ready["size"], ready["bucket"]) == ("24x32", 1)
    assert [e["size"] for e in host0 if e["event"] == "size_ready"] == ["32x24"]
    assert [e["slice"] for e in host0 if e["event"] == "slice_skipped"] == [square["first_slice"]]
    [done] = [e for e in host0 if e["event"] == "host_done"]
    assert done["slices_skipped"] == 1 and done["slices_generated"] == 2
    assert [name for name in trees.checksums(out) if not naming.owned(name)] == []
    _overwrite_keeps_links(tmp_path, out, os.path.join(os.path.dirname(sized_run), "p.jsonl"), model_cache)


def _overwrite_keeps_links(tmp_path, out, prompts, model_cache):
    victim = tmp_path / "victim"
    (victim / "folder").mkdir(parents=True)
    for name in ("cat.png", "thesis.tex", "folder/data.csv"):
        (victim / name).write_text(f"the user's {name}")
    os.symlink(victim, os.path.join(out, "images", "00099"))
    os.symlink(victim, os.path.join(out, "zarr", "images"))
    os.symlink(victim / "cat.png", os.path.join(out, "shards", "00098_stats.json"))
    os.symlink(".", os.path.join(out, "a"))
    os.symlink(".", os.path.join(out, "b"))
    result = run_cli(["plan", "--prompts", prompts, "--out", out,
                      "--model", "tiny", "--steps", "2", "--overwrite"], model_cache, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {name: (victim / name).read_text() for name in ("cat.png", "thesis.tex", "folder/data.csv")} == {
        name: f"the user's {name}" for name in ("cat.png", "thesis.tex", "folder/data.csv")}
    links = {os.path.relpath(os.path.join(root, name), out) for root, dirs, files in os.walk(out)
             for name in dirs + files if os.path.islink(os.path.join(root, name))}
    assert links == {"images/00099", "zarr/images", "shards/00098_stats.json", "a", "b"}
    [event] = [e for e in map(logs.parse, result.stderr.splitlines()) if e and e["event"] == "overwrite"]
    assert event["level"] == "warning" and len(event["links_kept"]) == 5
    left = sorted(name for name in trees.checksums(out) if not name.startswith(("plan/slices/", "plan/keys/")))
    assert left == ["plan/input_cache.json", "plan/inputs.json", "plan/manifest.json", "plan/model_files.json",
                    "run.json"]  # the new plan
    assert storage.read_json(naming.run_json(out))["settings"]["steps"] == 2


def test_status_shows_each_sizes_slices_images_and_slice_size(sized_run):
    from pipeline.collect import status

    found = status.status(sized_run)
    assert [(r["size"], r["committed_slices"], r["slices"], r["committed_images"], r["images"])
            for r in found["sizes"]] == [("32x32", 1, 1, 2, 2), ("24x32", 2, 2, 3, 3), ("32x24", 1, 1, 2, 2)]
    text = status.format_text(found)
    assert "slice=2/2/2" in found["settings"] and "  sizes     32x32: 1/1 slices, images 2/2 (slice 2)" in text
    assert "            24x32: 2/2 slices, images 3/3 (slice 2)" in text


def test_zarr_has_a_group_per_size_that_xarray_opens_with_keys(sized_run):
    import xarray as xr

    out = sized_run
    rows = _rows(out)
    for size, count in (("32x32", 2), ("24x32", 3), ("32x24", 2)):
        width, height = buckets.parse_size(size)
        dataset = xr.open_zarr(naming.join(out, "zarr"), group=size, consolidated=True)
        assert dict(dataset.sizes) == {"image": count, "height": height, "width": width, "channel": 3}
        for index, key in enumerate(dataset["key"].values):
            assert rows[key]["width"] == width
            assert int(rows[key]["position"]) - min(int(r["position"]) for r in rows.values()
                                                     if (r["width"], r["height"]) == (width, height)) == index
        first = str(dataset["key"].values[0])
        pixels = np.asarray(dataset["images"][0])
        files = {r["key"]: r for r in rows.values()}
        assert hashlib.sha256(writer.formats.encode(pixels, "png")).hexdigest() == files[first]["sha256"]




def test_auto_chooses_each_sizes_batch_and_a_resumed_run_keeps_them(tmp_path, monkeypatch):
    """--per-device-batch auto on this machine: each size's largest batch, from its own
    program's memory (faked here: 1 MiB a 32x32 image); a resumed run keeps every size's."""
    from pipeline.generate import fit
    from pipeline.io import runs

    mib = 2 ** 20
    monkeypatch.setattr(fit, "device_capacity", lambda devices, memory, on_machine=None: (40 * mib, "faked"))
    monkeypatch.setattr(fit, "sampler_memory", lambda model, spec, *args, **kwargs: {
        "total": 4 * mib + spec.per_device_batch * mib * spec.width * spec.height // (32 * 32)})
    asked = Settings(out=str(tmp_path / "out"), model="tiny", sizes=("64x64", "32x32", "32x64"),
                     per_device_batch="auto", steps=1)
    chosen = fit.resolve_per_device_batch(asked)
    assert (chosen.per_device_batch, chosen.bucket_batches) == (9, (9, 36, 18))  # 4 + 4b, 4 + b, 4 + 2b <= 40
    assert chosen.for_bucket(1).per_device_batch == 36 and chosen.replace(batches_per_slice=2).slice_size == 9 * 2
    _, run = __import__("pipeline.plan.prepare", fromlist=["x"]).resolve_settings(chosen)
    runs.write(asked.out, run)
    monkeypatch.setattr(fit, "choose_bucket_batches", lambda *a, **k: pytest.fail("chosen again"))
    assert fit.resolve_per_device_batch(asked).bucket_batches == (9, 36, 18)


def test_the_tpu_check_checks_every_size_compiling_whole_only_what_the_parts_cannot_settle(monkeypatch):
    """Memory-figure fakes (the suite's tiny TPU compiles are test_tpu_check.py's): parts
    grow with the pixels and the batch; the whole program needs 1.2x its parts. The
    heaviest size is searched and compiled whole; a size whose scaled parts need no more
    than that program is settled by its parts; a smaller size fitting more images is
    confirmed whole. A size that does not fit is refused by name, with its figures."""
    from pipeline.generate import tpu_check
    from pipeline.generate.tpu_check import sizes as size_check

    gib, limit = 2 ** 30, 14 * 2 ** 30
    parts = lambda context, b, enough=None: int(b * context.width * context.height / 2 ** 20 * 1.5 * gib)  # noqa
    whole = []

    def check(settings, target, b):
        whole.append((f"{settings.width}x{settings.height}", b))
        total = 2 * gib + 1.2 * b * settings.width * settings.height / 2 ** 20 * 1.5 * gib
        return {"model": "random-sdxl", "width": settings.width, "height": settings.height, "dtype": "bf16",
                "guided": True, "steps": 20, "attention": "auto", "per_device_batch": b, "total_gib": total / gib,
                "temp_gib": 1.0, "compiled": True, "tpu_type": "v5e", "hbm_gib": 16.0, "usable_gib": 15.75,
                "limit_gib": 14.0, "fits": total <= limit}

    def largest(settings, target, most=256):
        b = 1
        while check(settings, target, b + 1)["fits"]:
            b += 1
        whole.clear()  # the search's own compiles are largest_batch's (test_tpu_check.py)
        return b, {}

    monkeypatch.setattr(tpu_check.chips, "capacity", lambda target: (limit, limit))
    monkeypatch.setattr("pipeline.generate.runtime.abstract_model", lambda settings: _Shapes())
    monkeypatch.setattr("pipeline.model.sharding.device_bytes", lambda params, fsdp, dtype: 2 * gib)
    monkeypatch.setattr(size_check, "parts_memory", parts)
    monkeypatch.setattr(size_check, "check", check)
    monkeypatch.setattr(size_check, "largest_batch", largest)
    chip = tpu_check.Target("v5e", 4, 16.0)
    asked = Settings(model="random-sdxl", dtype="bf16", sizes=("512x512", "1024x1024", "832x1216"),
                     per_device_batch="auto", steps=20)
    settings, reports = size_check.check_sizes(asked, chip)
    # 1024x1024: 2 + 1.8b GiB <= 14 -> 6; 512x512: 2 + 0.45b -> 26, confirmed whole; 832x1216 (0.96 MP) at 6: parts
    assert settings.bucket_batches == (26, 6, 6) and settings.per_device_batch == 26
    assert [r["confirmed"] for r in reports] == ["whole program", "whole program", "parts"]
    assert whole == [("1024x1024", 6), ("512x512", 26)]  # two whole programs for three sizes
    assert reports[2]["total_gib"] <= reports[1]["total_gib"]
    with pytest.raises(tpu_check.DoesNotFit, match=r"size 1024x1024: random-sdxl 1024x1024 bf16 .* at 7 image\(s\) "
                                                    r"per chip needs 14\.60 GiB"):
        size_check.check_sizes(asked.replace(per_device_batch=7), chip)
    with pytest.raises(tpu_check.DoesNotFit, match=r"size 512x512: .* at 30 image\(s\)"):
        size_check.check_sizes(asked.replace(per_device_batch=6, bucket_batches=(30, 6, 6)), chip)


def test_beam_workers_generate_each_size_with_its_own_program_as_the_pod_hosts_did(sized_run, tmp_path):
    """The pod run's plan, generated again by the beam engine's Generate step (what ``submit
    dataflow`` runs) under TestPipeline on this process's 2 devices, its other sizes' slices
    committed already (skipped, as a resumed run's): the portrait size's slices, with that
    size's program, byte for byte the pod hosts' images, in the size's zarr group."""
    import shutil

    from apache_beam.testing.test_pipeline import TestPipeline

    from pipeline.engines import beam as beam_engine
    from pipeline.output import formats

    out = str(tmp_path / "again")
    shutil.copytree(naming.join(sized_run, "plan"), naming.join(out, "plan"))
    for path in (naming.run_json, naming.model_files):
        shutil.copy(path(sized_run), path(out))
    manifest = storage.read_json(naming.manifest(out))
    tall = next(b for b in manifest["buckets"] if b["size"] == "24x32")
    portrait = range(tall["first_slice"], tall["first_slice"] + tall["slices"])
    for index in set(range(manifest["slices"])) - set(portrait):
        storage.write_bytes(naming.shard_stats(out, index), storage.read_bytes(naming.shard_stats(sized_run, index)))
    with TestPipeline() as p:
        beam_engine.build_generate(p, out, manifest["slices"])
    again = {}
    for index in portrait:
        again.update({r["key"]: r["sha256"] for r in writer.read_parquet_rows(naming.shard_metadata(out, index))})
    rows = _rows(sized_run)
    assert again == {key: row["sha256"] for key, row in rows.items() if (row["width"], row["height"]) == (24, 32)}
    assert len(again) == 3 and formats.read_zarr_images(out, "24x32").shape == (3, 32, 24, 3)
    assert not storage.exists(naming.shard_metadata(out, 0))  # the square size's slice: skipped


@pytest.mark.parametrize("model, sizes, expected", [
    ("random-sdxl", ("common",), "1024x1024,1152x896,896x1152,1216x832,832x1216,1344x768,768x1344,1536x640,"
                                 "640x1536"),
    ("tiny-klein", ("common",), "32x32,36x28,28x36,40x24,24x40,48x20,20x48"),  # its default size is 32
    ("tiny-flux", ("32x32", "24x32", "32x24"), "32x32,24x32,32x24"),
    ("tiny-zimage", ("64x64", "1024x64"), "--sizes 1024x64: the width 1024: zimage images are at most 256 pixels"),
    ("random-flux", ("1024x1024", "1032x1024"), "--sizes 1032x1024: the width 1032: random-flux's images are "
                                                "multiples of 16 pixels"),
])
def test_each_family_plans_the_sizes_its_rule_allows(model, sizes, expected, tmp_path):
    """Every size of a run is checked against the family's size rule when planning, and
    the common preset is scaled to the family's native area and rounded to its unit."""
    from pipeline.plan import layout, prepare

    asked = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "out"), model=model, sizes=sizes, steps=1)
    if expected.startswith("--"):
        with pytest.raises(layout.PlanError, match=re.escape(expected)):
            prepare.resolve_settings(asked)
        return
    settings, run = prepare.resolve_settings(asked)
    assert ",".join(settings.sizes) == expected
    assert (settings.width, settings.height) == buckets.parse_size(settings.sizes[0])  # the default
    one = prepare.resolve_settings(asked.replace(sizes=settings.sizes[:1]))[1]
    assert run.settings_fingerprint != one.settings_fingerprint  # the sizes are part of the fingerprint


def test_the_sizes_bench_compares_one_run_with_the_single_size_runs_and_finds_the_gaps():
    """``bench sizes``' comparison (pure; the bench itself runs whole commands: docs/benchmarks.md)."""
    from pipeline.bench import sizes as sizes_bench

    alone = {name: {"images": 10, "seconds": 10.0, "generate_s": 4.0, "hashes": {f"{name}-{n}": n for n in range(2)}}
             for name in ("a", "b")}
    switch = {"host": 0, "size": "b", "idle_s": 0.5, "batch_s": 1.0}
    sized = {"images": 20, "seconds": 16.0, "generate_s": 8.0, "switches": [switch],
             "hashes": {**alone["a"]["hashes"], **alone["b"]["hashes"]}}
    found = sizes_bench.summarize(sized, alone)
    assert found["ratio"] == 1.25 and found["ratio_at_least_0_9"] and found["generate_ratio"] == 1.0
    assert found["no_gap_over_a_batch"] and found["same_bytes"] and found["worst_switch"] == switch
    late = sizes_bench.summarize({**sized, "seconds": 25.0, "switches": [{**switch, "idle_s": 3.0}],
                                  "hashes": {**sized["hashes"], "a-0": 7}}, alone)
    assert not late["ratio_at_least_0_9"] and not late["no_gap_over_a_batch"] and not late["same_bytes"]


def test_the_sizes_bench_says_where_it_is_as_each_run_starts_and_ends(tmp_path, caplog):
    """`promptmill bench sizes` runs for minutes: each of its runs is an event as it starts
    and as it ends (here one refused at once)."""
    import logging

    from pipeline.bench import sizes as sizes_bench

    with caplog.at_level(logging.INFO, logger="promptmill"), pytest.raises(RuntimeError, match="failed"):
        sizes_bench._run(["--no-such-flag"], str(tmp_path / "out"), str(tmp_path / "cache"))
    said = [json.loads(r.getMessage()) if r.getMessage().startswith("{") else r.getMessage() for r in caplog.records]
    assert [s for s in said if s in ("bench_run_started", "bench_run_done")] == ["bench_run_started", "bench_run_done"]
