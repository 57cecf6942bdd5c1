"""The host loop overlaps the devices with the host's own work: the next batch is
tokenised and dispatched before the current one is fetched, and images go to a
bounded writer pool. It must write exactly what a plain sequential loop writes."""
import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

from pipeline.core import naming, records
from pipeline.core.settings import Run, Settings
from pipeline.generate import host_loop as host
from pipeline.generate.generator import Generator
from pipeline.io import storage
from pipeline.model import load as model_lib
from pipeline.output import formats, writer
from pipeline.generate.spec import ProgramSpec

SIZE = 6  # three batches of two: two in flight at a time


@pytest.fixture(scope="module")
def generator(model_cache):
    return Generator(model_lib.load("tiny", dtype="fp32", scheduler="ddim"), ProgramSpec(32, 32, 2, 1),
                     jax.local_devices()[:2])


def planned_out(tmp_path, count):
    """An OUT holding run.json and one plan slice of ``count`` items (the last ones padding)."""
    out = str(tmp_path / "out")
    run = Run.create(Settings(width=32, height=32, steps=2, guidance_scale=7.5, model="tiny", scheduler="ddim"),
                     "f" * 64, created_at="2026-01-02T03:04:05+00:00", versions={})
    recs = [records.Record(id=f"r{n}", prompt=f"prompt {n}", negative_prompt="blurry" if n % 2 else "",
                           seed=1000 + n, num_images=1, guidance_scale=3.0 if n == 1 else None, source="p.jsonl",
                           line=n + 1) for n in range(count)]
    items = [records.expand(r, n, SIZE)[0] for n, r in enumerate(recs)]
    storage.write_text(naming.plan_slice(out, 0), "".join(json.dumps(i.to_json()) + "\n" for i in items))
    return out, run, items


def test_the_overlapped_loop_writes_what_a_sequential_loop_writes(generator, tmp_path):
    out, run, items = planned_out(tmp_path, SIZE - 1)
    with ThreadPoolExecutor(host.WRITER_THREADS) as pool:
        [stats] = host.run_slices(host.one_size(generator, run, SIZE), out, [0], 0, pool)
    assert stats["images"] == SIZE - 1 and stats["padding"] == 1
    assert min(stats["input_s"], stats["device_wait_s"], stats["output_s"]) >= 0
    assert stats["input_s"] + stats["device_wait_s"] + stats["output_s"] <= stats["seconds"]
    assert 0 < stats["device_busy_s"] <= stats["seconds"]

    # the sequential reference: generate a batch, wait for it, encode each image, in order
    padded = [*items, None]
    expected = {}
    for start in range(0, SIZE, generator.batch_size):
        chunk = padded[start:start + generator.batch_size]
        images, _ = generator.generate(generator.batch_of([None if i is None else i.inputs(7.5) for i in chunk]))
        for item, image in zip(chunk, images):
            if item is not None:
                expected[item.key] = formats.encode(image, "png")
    rows = writer.read_parquet_rows(naming.shard_metadata(out, 0))
    assert [row["key"] for row in rows] == [item.key for item in items]  # rows in position order
    for row in rows:
        assert storage.read_bytes(naming.join(out, row["path"])) == expected[row["key"]]
        assert row["sha256"] == hashlib.sha256(expected[row["key"]]).hexdigest()
    assert writer.is_committed(out, 0)


def test_the_writer_pool_applies_backpressure(tmp_path):
    out, run, items = planned_out(tmp_path, 5)
    gate = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        slice_writer = writer.SliceWriter(out, run, 0, 0, pool, max_pending=2)
        original = slice_writer._write_one
        slice_writer._write_one = lambda *a: (gate.wait(), original(*a))[1]  # uploads stall until the gate opens
        added = []

        def producer():
            for item in items:
                slice_writer.add(item, np.zeros((32, 32, 3), np.uint8))
                added.append(item.key)

        thread = threading.Thread(target=producer)
        thread.start()
        time.sleep(0.5)
        assert len(added) == 2  # the third add waits for a free slot: memory stays bounded
        gate.set()
        thread.join(timeout=30)
        assert len(added) == 5
        rows = slice_writer.commit({"slice": 0, "images": 5})
    assert [row["key"] for row in rows] == [item.key for item in items]


def test_a_failed_encoder_fails_the_slice_loudly_and_commits_nothing(generator, tmp_path, monkeypatch):
    out, run, _ = planned_out(tmp_path, SIZE)
    encode, calls = formats.encode, []

    def failing(image, *args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("injected: the encoder failed")
        return encode(image, *args)

    monkeypatch.setattr(formats, "encode", failing)
    with ThreadPoolExecutor(host.WRITER_THREADS) as pool:
        with pytest.raises(OSError, match="injected"):
            host.run_slices(host.one_size(generator, run, SIZE), out, [0], 0, pool)
    assert not writer.is_committed(out, 0)  # redone by the next run, never half-counted as done
    assert not storage.exists(naming.shard_metadata(out, 0))


def two_slices(tmp_path):
    """An OUT with two planned slices of SIZE (the second one short: padding)."""
    out, run, first = planned_out(tmp_path, SIZE)
    recs = [records.Record(id=f"s{n}", prompt=f"second slice {n}", negative_prompt="", seed=2000 + n, num_images=1,
                           guidance_scale=None, source="p.jsonl", line=100 + n) for n in range(SIZE - 2)]
    second = [records.expand(r, SIZE + n, SIZE)[0] for n, r in enumerate(recs)]
    storage.write_text(naming.plan_slice(out, 1), "".join(json.dumps(i.to_json()) + "\n" for i in second))
    return out, run, first, second


def test_slices_overlap_across_their_boundaries_and_commit_in_order(generator, tmp_path):
    out, run, first, second = two_slices(tmp_path)
    commits = []
    with ThreadPoolExecutor(host.WRITER_THREADS) as pool:
        stats = host.run_slices(host.one_size(generator, run, SIZE), out, [0, None, 1], 0, pool,
                                on_commit=lambda s: commits.append((s["slice"], writer.is_committed(out, s["slice"]))))
    assert [s["slice"] for s in stats] == [0, 1] and commits == [(0, True), (1, True)]
    assert [s["images"] for s in stats] == [SIZE, SIZE - 2] and stats[1]["padding"] == 2
    assert all(s["commit_s"] >= 0 for s in stats)
    written = storage.glob(naming.join(out, "images", "*", "*.png"))  # padding rows and slots: nothing
    assert sorted(written) == sorted(naming.join(out, naming.image_name(i.slice, i.key)) for i in first + second)
    for index, items in enumerate((first, second)):  # each slice's bytes are those of a slice run alone
        alone = str(tmp_path / f"alone-{index}")
        storage.write_text(naming.plan_slice(alone, index), storage.read_text(naming.plan_slice(out, index)))
        with ThreadPoolExecutor(host.WRITER_THREADS) as pool:
            host.run_slices(host.one_size(generator, run, SIZE), alone, [index], 0, pool)
        for item in items:
            path = naming.image_name(index, item.key)
            assert storage.read_bytes(naming.join(out, path)) == storage.read_bytes(naming.join(alone, path))


def test_a_failed_commit_stops_the_host_and_later_slices_stay_uncommitted(generator, tmp_path, monkeypatch):
    out, run, _, _ = two_slices(tmp_path)

    def failing(rows):
        raise OSError("injected: the metadata shard upload failed")

    monkeypatch.setattr(writer, "parquet_bytes", failing)
    with ThreadPoolExecutor(host.WRITER_THREADS) as pool:
        with pytest.raises(OSError, match="injected"):
            host.run_slices(host.one_size(generator, run, SIZE), out, [0, 1], 0, pool)
    assert not writer.is_committed(out, 0) and not writer.is_committed(out, 1)


def test_device_busy_time_counts_each_step_from_its_start_on_the_devices():
    clock = host._DeviceClock()
    assert clock.busy((10.0, 11.0)) == 1.0  # dispatched to idle devices: busy from dispatch to end
    assert clock.busy((10.5, 12.0)) == 1.0  # queued behind the first: runs from 11.0
    assert clock.busy((13.0, 13.25)) == 0.25  # the devices idled from 12.0 to 13.0
    assert clock.busy((13.1, 13.2)) == 0.0  # (reported out of order: never negative)
