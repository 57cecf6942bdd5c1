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
    assert path.startswith(out + "/images/00012/")


def test_keys_are_unique_across_hostile_ids_and_indices():
    ids = HOSTILE + ["a-b", "a_b", "a--b-", "x" * 9_999, "x" * 10_001]
    keys = [naming.output_key(i, n) for i in ids for n in (0, 1, 12, 9999)]
    assert len(set(keys)) == len(keys)


def test_safe_ids_are_kept_readable():
    assert naming.output_key("lighthouse", 0) == "lighthouse_0000"
    assert naming.output_key("img-42_b", 7) == "img-42_b_0007"


def test_image_index_range_is_enforced():
    with pytest.raises(ValueError):
        naming.output_key("a", naming.MAX_IMAGES_PER_RECORD)


def test_paths_join_local_and_gcs_alike():
    assert naming.shard_stats("gs://b/run/", 3) == "gs://b/run/shards/00003_stats.json"
    assert naming.plan_slice("/tmp/o", 12) == "/tmp/o/plan/slices/00012.jsonl"
    assert naming.shard_metadata("o", 0) == "o/shards/00000.parquet"
