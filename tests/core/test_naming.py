import os
import re

import pytest

from pipeline.core import naming

HOSTILE = ["../../x", "a/b", "/etc/passwd", "..", ".", "a.b.c", "x" * 10_000, "ünïcödé 🎨", "tab\there",
           "nul\x00byte", "new\nline", "a--b", "-lead", "a b", "C:\\win", "%2e%2e%2f", "a_0000", "A", "a"]


@pytest.mark.parametrize("record_id", HOSTILE)
def test_keys_are_safe_file_names(record_id):
    key = naming.output_key(record_id, 3)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", key), key
    assert "." not in key and len(key) <= 80
    out = "/data/out"
    path = os.path.normpath(naming.join(out, naming.image_name(12, key)))
    assert path.startswith(naming.images_dir(out, 12) + "/") and naming.images_dir(out, 12).startswith(out + "/images/")


def test_keys_are_unique_across_hostile_ids_and_indices():
    ids = HOSTILE + ["a-b", "a_b", "a--b-", "x" * 9_999, "x" * 10_001]
    keys = [naming.output_key(i, n) for i in ids for n in (0, 1, 12, 9999)]
    assert len(set(keys)) == len(keys)


def test_safe_ids_are_kept_readable():
    assert naming.output_key("lighthouse", 0) == "lighthouse_0000"
    assert naming.output_key("img-42_b", 7) == "img-42_b_0007"


FILES = ["prompts.jsonl", "a/p.txt", "b/p.txt", "parts/part-00001.jsonl.gz", "x.txt", "x.jsonl", "x-y/p.csv",
         "x/y-p.csv", "Über café.txt", "...txt", "a b/c d.parquet"]


def test_records_without_an_id_are_named_by_their_file_and_line():
    labels = naming.file_labels(FILES)
    assert naming.output_key("prompts.jsonl:12", 0, labels) == "prompts--L12_0000"
    assert naming.output_key("parts/part-00001.jsonl.gz:3", 2, labels) == "parts-part-00001--L3_0002"
    # same-named files in other folders, one stem in two formats, slugs alike: told apart
    assert (labels["a/p.txt"], labels["b/p.txt"], labels["x.txt"], labels["x.jsonl"]) == ("a-p", "b-p", "x-txt",
                                                                                          "x-jsonl")
    assert labels["x-y/p.csv"] != labels["x/y-p.csv"] and labels["x-y/p.csv"].startswith("x-y-p-csv-")
    assert labels["Über café.txt"] == "Uber-cafe" and labels["...txt"] == "file"
    assert len(set(labels.values())) == len(FILES) and all("--" not in label for label in labels.values())
    assert naming.file_labels(reversed(FILES)) == labels  # of the set of files alone
    for label in labels.values():
        assert re.fullmatch(r"[A-Za-z0-9_-]+", label) and len(label) <= 49


def test_readable_keys_are_unique_against_user_ids_hashed_ids_and_each_other():
    labels = naming.file_labels(FILES)
    auto = [f"{f}:{line}" for f in FILES for line in (1, 2, 10, 12, 1234567890123456)]
    users = HOSTILE + ["prompts--L12", "prompts-L12", "a-p--L1", "prompts", "x-txt--L1", "p.txt:1", "a/p.txt:01",
                       "a/p.txt:", "nofile.txt:3"]
    keys = [naming.output_key(i, n, labels) for i in auto + users for n in (0, 7)]
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert re.fullmatch(r"[A-Za-z0-9_-]+", key) and "." not in key
    # an id that is not FILE:LINE of a run's file keeps its hashed name, as before
    assert naming.output_key("a/p.txt:01", 0, labels) == naming.output_key("a/p.txt:01", 0)
    assert naming.output_key("nofile.txt:3", 0, labels) == naming.output_key("nofile.txt:3", 0)
    assert naming.output_key("a/p.txt:1", 0) == naming.key_stem("a/p.txt:1") + "_0000"  # hashed runs: as before


def test_image_index_range_is_enforced():
    with pytest.raises(ValueError):
        naming.output_key("a", naming.MAX_IMAGES_PER_RECORD)


def test_paths_join_local_and_gcs_alike():
    assert naming.shard_stats("gs://b/run/", 3) == f"gs://b/run/shards/{naming.output_name(3)}_stats.json"
    assert naming.plan_slice("/tmp/o", 12) == "/tmp/o/plan/slices/00012.jsonl"
    assert naming.shard_metadata("o", 0) == f"o/shards/{naming.output_name(0)}.parquet"


def test_per_slice_output_names_spread_over_the_key_space():
    """A short hash of the slice before its number: consecutive slices' objects do not share
    a name prefix beyond their folder, and the name still reads as its slice."""
    names = [naming.output_name(i) for i in range(4096)]
    assert names[42] == naming.output_name(42) and re.fullmatch(r"[0-9a-f]{4}-00042", names[42])
    assert len(set(names)) == len(names)
    assert len({name[0] for name in names[:64]}) == 16  # the first character alone spreads 64 slices over 16 ranges
    assert sorted(names) != names  # written in slice order, they do not arrive in name order
    for index in (0, 7, 99_999, 123_456):
        for path in (naming.shard_tar("o", index), naming.image_parquet("o", index), naming.thumb_pack("o", index),
                     naming.images_metadata("o", index), naming.join("o", naming.image_name(index, "k_0000"))):
            assert naming.output_name(index) in path and naming.owned(path[len("o/"):]), path
        assert naming.marker_slice(naming.shard_stats("gs://b/o", index)) == index
    # a marker-like name whose hash is not its slice's is no marker (a stray or renamed object)
    assert naming.marker_slice("shards/0000-00042_stats.json") is None
    assert naming.marker_slice("shards/00042_stats.json") is None


def test_owned_names_the_new_layouts_objects_and_the_earlier_ones():
    """--overwrite deletes a run of either layout: the names of layout 1 stay owned."""
    for name in ("dataset/metadata/part-00003.parquet", "dataset/index/00017.parquet", "plan/keys/00000.parquet",
                 "thumbs/5fec-00000.tar", "images/5fec-00000/metadata.jsonl",
                 # layout 1's
                 "dataset/metadata.parquet", "images/metadata.jsonl", "images/00000/k_0000.png",
                 "thumbs/00000/k_0000.jpg", "shards/00000_stats.json"):
        assert naming.owned(name), name
    for name in ("dataset/metadata/notes.txt", "thumbs/5fec-00000.zip", "images/5fec-00000/notes.jsonl"):
        assert not naming.owned(name), name




# A sample value for each parameter a path function of naming takes: what writers pass.
_SAMPLES = {"out": ["/o"], "logs": ["/o/logs"], "index": [0, 123456], "host": [0, 17],
            "key": ["a_cat--0123456789abcdef_0007"], "ext": ["png", "jpg", "webp"], "group": ["", "24x32"],
            "source": ["gs://b/p[1]/x.jsonl"], "first_position": [0, 10 ** 12], "attempt": [1, 12],
            "part": [0, 12345], "bucket": [0, 17]}
_SAMPLES_OF = {"host_log": {"logs": ["/o/logs", "/o/logs/attempt-3"]}, "dataset_file": {"name": ["stats.json", "index.html", "gallery/page-00002.html"]},
               "progress_file": {"name": [naming.progress_name(0), naming.progress_name(12345)]},
               "plan_section": {"kind": ["ids", "prompts", "drops", "keys"]},
               "plan_range": {"kind": ["ids", "prompts"], "hash_range": [0, 123456]}}
# folders: the names their writers give under them
_UNDER = {"rejects_dir": ["x--0123456789abcdef.jsonl"], "images_dir": ["k_0000.png", "metadata.jsonl"], "logs_dir": [
    "host-3.log", "hosts.json", "attempt-2/host-0.log", "attempt-2/hosts.json"],
    "progress_dir": ["host-00003.json"], "ledger_dir": ["host-00003.json"], "zarr_group": ["zarr.json", "images/zarr.json", "images/c/0/0/0/0",
                                                         "latents/c/1/0/0/0", "dropped/c/0", "key/c/0"],
    "zarr_images": ["zarr.json", "c/0/0/0/0"], "zarr_latents": ["zarr.json", "c/3/0/0/0"],
    "attempt_logs": ["host-0.log", "hosts.json"]}


def _path_functions():
    import inspect

    for name, function in vars(naming).items():
        if isinstance(function, naming.Fixed):
            yield name, function, ["out"]
        elif isinstance(function, naming.PerSlice):
            yield name, function, ["out", "index"]
        elif inspect.isfunction(function) and function.__module__ == naming.__name__ and not name.startswith("_"):
            params = list(inspect.signature(function).parameters)
            if params and params[0] in ("out", "logs"):
                yield name, function, params


def test_every_name_a_path_function_gives_is_owned_by_the_rule_registered_with_it():
    """The ownership rule is the union of the writers' own patterns: every path function
    of naming either is registered with the pattern of what it gives (``naming.writes``)
    or takes a logs folder it joins into; each name it gives, for every sample of its
    parameters, is owned, so --overwrite deletes it; a path function added without a
    pattern fails here."""
    import itertools

    checked = 0
    for name, function, params in _path_functions():
        if name == "join":
            continue
        names = []
        samples = {**_SAMPLES, **_SAMPLES_OF.get(name, {})}
        for values in itertools.product(*(samples[p] for p in params)):
            path = function(**dict(zip(params, values)))
            assert path.startswith("/o/"), (name, path)
            names += [f"{path}/{under}"[3:] for under in _UNDER[name]] if name in _UNDER else [path[3:]]
        assert names
        unowned = [n for n in names if not naming.owned(n)]
        assert unowned == [], (name, unowned)
        if params[0] == "out" and not isinstance(function, (naming.Fixed, naming.PerSlice)):  # their own pattern
            assert name in naming.WRITERS, f"naming.{name} gives a path under OUT but registers no pattern"
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("name", ["notes.txt", "zarr.json", "images/mine.png", "logs/app.log", "logs/attempt-1/x.txt",
                                  "zarr/mine/x", "zarr/24x32/notes.txt", "shards/notes.md", "plan/my-plan.txt",
                                  "dataset/mydata.csv", "progress/host-0.txt", "thumbs/00000/x.png"])
def test_a_users_own_names_are_not_owned(name):
    assert not naming.owned(name)
