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
    path = os.path.normpath(naming.image_file(out, 12, key))
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
                     naming.images_metadata("o", index), naming.image_file("o", index, "k_0000")):
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
