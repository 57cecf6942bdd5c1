"""Beam-side I/O (pipeline.io.beamio): local paths and gs:// (the emulator)."""
import gzip
import io
import json
import os

import pytest
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.testing.test_pipeline import TestPipeline

from pipeline.io import beamio, storage
from pipeline.plan import transforms as plan
from pipeline.plan.prepare import prepare

# plain, CRLF, blank lines, invalid UTF-8 kept as bytes, last line without a newline
CONTENT = b'{"prompt": "one"}\n\n{"prompt": "caf\xc3\xa9"}\r\n\xff\xfe not utf-8\n\r\n  \nlast'
LINES = [b'{"prompt": "one"}', b"", '{"prompt": "café"}'.encode(), b"\xff\xfe not utf-8", b"", b"  ", b"last"]


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path)
    bucket = request.getfixturevalue("gcs_emulator")
    return f"gs://{bucket}/beamio/{os.path.basename(str(tmp_path))}"


@pytest.mark.parametrize("content,lines", [
    (CONTENT, LINES),
    (b"", []),
    (b"\n", [b""]),
    (b"a\n\n", [b"a", b""]),
    (b"a\r\r\n", [b"a"]),
    (b"a\rb\n", [b"a\rb"]),
])
def test_split_lines_matches_storage_iter_lines(tmp_path, content, lines):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    assert list(beamio.split_lines(io.BytesIO(content))) == lines == list(storage.iter_lines(str(path)))


def test_split_lines_across_chunk_boundaries(monkeypatch):
    monkeypatch.setattr(beamio, "READ_CHUNK", 3)
    content = b"abcdefgh\n\nij\r\nklmnopqrstu\nv"
    assert list(beamio.split_lines(io.BytesIO(content))) == [b"abcdefgh", b"", b"ij", b"klmnopqrstu", b"v"]


def test_read_lines_plain_and_gz(root):
    storage.write_bytes(f"{root}/p.jsonl", CONTENT)
    storage.write_bytes(f"{root}/p.jsonl.gz", gzip.compress(CONTENT))
    assert list(beamio.iter_lines(f"{root}/p.jsonl")) == LINES
    assert list(beamio.iter_lines(f"{root}/p.jsonl.gz")) == LINES  # decompressed by name


def test_write_then_read(root):
    beamio.write_bytes(f"{root}/new/folder/b.bin", b"\x00\xffbytes")
    beamio.write_text(f"{root}/t.jsonl", "é\n")
    beamio.write_json(f"{root}/j.json", {"b": [1, 2], "a": "é"})
    storage.write_json(f"{root}/j_storage.json", {"b": [1, 2], "a": "é"})
    assert beamio.read_bytes(f"{root}/new/folder/b.bin") == storage.read_bytes(f"{root}/new/folder/b.bin") == \
        b"\x00\xffbytes"
    assert beamio.read_text(f"{root}/t.jsonl") == "é\n"
    assert beamio.read_json(f"{root}/j.json") == {"b": [1, 2], "a": "é"}
    # the same bytes as pipeline.io.storage writes
    assert storage.read_bytes(f"{root}/j.json") == storage.read_bytes(f"{root}/j_storage.json")
    assert beamio.read_bytes(f"{root}/j_storage.json") == storage.read_bytes(f"{root}/j_storage.json")


def test_a_gz_name_is_written_uncompressed(root):
    beamio.write_bytes(f"{root}/raw.jsonl.gz", b"not gzipped\n")
    assert storage.read_bytes(f"{root}/raw.jsonl.gz") == b"not gzipped\n"


def test_an_error_while_writing_to_gcs_leaves_no_object(gcs_emulator):
    path = f"gs://{gcs_emulator}/beamio/failed.json"
    with pytest.raises(RuntimeError):
        with beamio._filesystems().create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
            f.write(b"partial")
            raise RuntimeError("boom")
    assert not storage.exists(path)


def test_emulator_credentials_skip_beams_lookup(gcs_emulator, monkeypatch):
    from apache_beam.internal.gcp import auth

    monkeypatch.setattr(auth._Credentials, "_credentials_init", False)
    monkeypatch.setattr(auth._Credentials, "_get_service_credentials",
                        staticmethod(lambda options: pytest.fail("Beam looked up credentials")))
    beamio.write_bytes(f"gs://{gcs_emulator}/beamio/anon.txt", b"x")
    assert beamio.read_bytes(f"gs://{gcs_emulator}/beamio/anon.txt") == b"x"


def test_lines_are_read_strictly_from_plain_and_gzipped_objects(root):
    """The one line reader (``iter_lines``): a gzipped object that ends early is an error,
    never a shorter file (there is no second, lenient reader of lines)."""
    storage.write_bytes(f"{root}/a.jsonl", CONTENT)
    storage.write_bytes(f"{root}/b.jsonl.gz", gzip.compress(b"b1\nb2"))
    storage.write_bytes(f"{root}/c.jsonl.gz", gzip.compress(b"c1\nc2\n" * 100)[:-9])
    assert list(beamio.iter_lines(f"{root}/a.jsonl")) == LINES
    assert list(beamio.iter_lines(f"{root}/b.jsonl.gz")) == [b"b1", b"b2"]
    with pytest.raises(beamio.TruncatedInput):
        list(beamio.iter_lines(f"{root}/c.jsonl.gz"))
    assert not hasattr(beamio, "ReadLines")


def test_the_plan_pipeline_reads_and_writes_gcs(gcs_emulator, model_cache):
    from pipeline.core import naming
    from pipeline.core.settings import Settings

    base = f"gs://{gcs_emulator}/beamio/plan"
    storage.write_bytes(f"{base}/in/x.jsonl", b'{"prompt": "1", "id": "a"}\n\n{"prompt": "3"}\r\n'
                                              b'{"prompt": "4", "id": "a"}\n')
    storage.write_bytes(f"{base}/in/sub/y.jsonl", b"\xff\n{oops")
    storage.write_bytes(f"{base}/in/sub/skip.txt", b"not matched\n")
    pattern, out = f"{base}/in/**/*.jsonl", f"{base}/out"
    settings, _ = prepare(Settings(prompts=pattern, out=out))
    with TestPipeline() as p:
        _ = p | "Plan" >> plan.Plan(settings)
    [slice_file] = storage.glob(f"{out}/plan/slices/*")
    assert [(i["prompt"], i["line"]) for i in map(json.loads, storage.read_text(slice_file).splitlines())] == [
        ("1", 1), ("3", 3)]
    rejects = {path.rsplit("/", 1)[1]: [(r["line"], r["reason"]) for r in map(json.loads,
                                                                            storage.read_text(path).splitlines())]
               for path in storage.glob(f"{out}/plan/rejects/*")}
    assert sorted(rejects.values()) == [[(1, "invalid_utf8"), (2, "invalid_json")], [(4, "duplicate_id")]]
    assert storage.read_json(naming.manifest(out))["input_rows"] == 5
    # what the checks and the placing steps wrote for later steps is gone; the key index is there
    assert storage.glob(f"{out}/plan/scans/*") == [] and len(storage.glob(f"{out}/plan/keys/*")) == 1


def test_invalid_utf8_reaches_validation_as_bytes(tmp_path):
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "ok"}\n\xff\xfe\n')
    results = [result for _, result in plan.validated(str(tmp_path / "p.jsonl"), 0, str(tmp_path))]
    assert [(r.line, r.reason) for r in results[1:]] == [(2, "invalid_utf8")] and results[0].prompt == "ok"


def test_gcs_paths_without_beams_gcs_support_get_a_clear_error(monkeypatch):
    import sys

    beamio.require_filesystem("/local/prompts/*.jsonl", "out")  # local paths never need it
    monkeypatch.setitem(sys.modules, "apache_beam.io.gcp.gcsfilesystem", None)  # as if not installed
    beamio.require_filesystem("/local/prompts/*.jsonl")
    with pytest.raises(RuntimeError, match=r"pip install 'promptmill\[gcp\]'"):
        beamio.require_filesystem("/local/prompts/*.jsonl", "gs://bucket/out")
