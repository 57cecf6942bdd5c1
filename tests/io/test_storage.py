"""The storage layer against local folders and the GCS emulator, with and without faults."""
import os

import pytest

from pipeline.io import gcs, inventory, listing, storage
from pipeline.testing.fault_proxy import FaultyProxy
from tests import trees


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "root")
    bucket = request.getfixturevalue("gcs_emulator")
    return f"gs://{bucket}/glob-test"


def test_write_read_exists_glob(root):
    for name in ("a/x.jsonl", "a/y.jsonl", "a/sub/z.jsonl", "b/w.txt"):
        storage.write_bytes(f"{root}/{name}", name.encode())
    assert storage.read_bytes(f"{root}/a/y.jsonl") == b"a/y.jsonl"
    assert storage.exists(f"{root}/b/w.txt") and not storage.exists(f"{root}/b/nope.txt")
    assert [p[len(root) + 1:] for p in storage.glob(f"{root}/a/*.jsonl")] == ["a/x.jsonl", "a/y.jsonl"]
    assert [p[len(root) + 1:] for p in storage.glob(f"{root}/a/**/*.jsonl")] == ["a/sub/z.jsonl", "a/x.jsonl",
                                                                              "a/y.jsonl"]
    assert [p[len(root) + 1:] for p in storage.glob(f"{root}/?/[wx].*")] == ["a/x.jsonl", "b/w.txt"]
    assert [p[len(root) + 1:] for p in storage.glob(f"{root}/a")] == ["a/sub/z.jsonl", "a/x.jsonl", "a/y.jsonl"]
    assert list(storage.iter_lines(f"{root}/b/w.txt")) == [b"b/w.txt"]
    assert set(trees.checksums(f"{root}/a")) == {"x.jsonl", "y.jsonl", "sub/z.jsonl"}


def test_what_a_listing_says_of_objects(root):
    root = f"{root}/listed"  # the emulator's bucket is the session's
    for name in ("a/x.jsonl", "a/sub/z.jsonl", "b/w.txt"):
        storage.write_bytes(f"{root}/{name}", name.encode())
    found = inventory.listed(f"{root}/a/**/*.jsonl")
    assert sorted(found) == [f"{root}/a/sub/z.jsonl", f"{root}/a/x.jsonl"] and found[f"{root}/a/x.jsonl"].size == 9
    assert sorted(inventory.listed_objects(f"{root}/a/")) == sorted(found)
    assert inventory.listed_paths([f"{root}/b/w.txt", f"{root}/b/nope.txt"]) == {
        f"{root}/b/w.txt": {"size": 7, "md5": inventory.listed_objects(f"{root}/b/w.txt")[f"{root}/b/w.txt"]["md5"]}}
    assert set(inventory.modified_times(root, ".txt")) == {f"{root}/b/w.txt"}
    assert storage.checksum(f"{root}/b/w.txt").startswith("7:")
    with pytest.raises(FileNotFoundError):
        storage.checksum(f"{root}/b/nope.txt")


def test_gcs_through_a_proxy_failing_one_request_in_ten(gcs_emulator, monkeypatch):
    upstream = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    with FaultyProxy(upstream, failure_rate=0.1, seed=3) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{proxy.port}")
        gcs.reset_client()
        root = f"gs://{gcs_emulator}/faulty"
        blobs = {f"{root}/o{n:03d}.bin": os.urandom(1000 + n) for n in range(60)}
        for path, data in blobs.items():
            storage.write_bytes(path, data)
        for path, data in blobs.items():
            assert storage.read_bytes(path) == data
            assert storage.exists(path)
        assert storage.glob(f"{root}/*.bin") == sorted(blobs)
        assert sum(proxy.counts[k] for k in ("503", "429", "dropped")) >= 10  # faults really happened
    gcs.reset_client()


@pytest.mark.parametrize("pattern,name,matches", [
    ("a/*.jsonl", "a/x.jsonl", True), ("a/*.jsonl", "a/b/x.jsonl", False), ("a/**/*.jsonl", "a/x.jsonl", True),
    ("a/**/*.jsonl", "a/b/c/x.jsonl", True), ("a/**", "a/b/c", True), ("a/x?.txt", "a/x1.txt", True),
    ("a/x?.txt", "a/x/.txt", False), ("a/[!x]*", "a/y", True), ("a/[!x]*", "a/x", False), ("a.b", "axb", False),
    ("*", ".promptmill-tmp-x", False), ("**", "a/.promptmill-tmp-x", False), ("**/*", ".hidden/x", False),
    (".*", ".hidden", True), ("a/.b/*", "a/.b/c", True), ("x*", "x.hidden", True),
])
def test_glob_regex(pattern, name, matches):
    """Glob semantics for names under a folder; a wildcard never matches a name's leading dot."""
    assert bool(listing.regex(pattern).match(name)) == matches
