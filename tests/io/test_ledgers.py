"""Per-host ledgers: a host finds its committed slices, and status counts a run's, without
listing every commit marker; a ledger that cannot be trusted falls back to the listing,
says so, and never makes anyone skip a slice that is not committed.

Real files under a local OUT; reads are counted by wrapping the storage layer's calls.
A real pod run with ledgers is in tests/e2e/test_e2e.py (killed, then resumed), the bench at
100,000 committed slices in docs/benchmarks.md."""
import random

import pytest

from pipeline.collect import status
from pipeline.core import buckets, naming
from pipeline.core.settings import Run, Settings
from pipeline.io import inventory, ledgers, runs, storage

MANIFEST = {"slices": 10, "slice_size": 4, "images": 38, "records": 38, "rejects": 0, "rejects_by_reason": {},
            "input_rows": 38}


@pytest.mark.parametrize("stride", [1, 3, 16])
def test_runs_of_a_stride_hold_exactly_the_slices_added_in_any_order(stride):
    rng = random.Random(stride)
    for _ in range(50):
        chosen = {stride * k + 2 for k in rng.sample(range(200), rng.randrange(0, 60))}
        found = []
        for index in rng.sample(sorted(chosen), len(chosen)):
            found = ledgers.add(found, index, stride)
        assert found == ledgers.runs_of(chosen, stride)
        assert ledgers.indices(found, stride) == chosen
        assert all(ledgers.contains(found, i) == (i in chosen) for i in range(2, 200 * stride, stride))
    assert ledgers.runs_of(range(5, 500, 5), 5) == [[5, 495]]  # a host's whole share: one run


def _out(tmp_path, hosts=2, committed=(0, 1, 2, 3, 5)):
    out = str(tmp_path / "out")
    run = Run.create(Settings(out=out, model="tiny", width=32, height=32, steps=3, scheduler="ddim",
                              devices_per_host=2, per_device_batch=1, batches_per_slice=2, guided=True),
                     "f" * 64, "2026-01-01T00:00:00+00:00", {})
    runs.write(out, run)
    storage.write_json(naming.manifest(out), MANIFEST)
    for index in committed:
        storage.write_json(naming.shard_stats(out, index), {"slice": index})
    return out, run


def _host(out, run, host, hosts=2):
    return ledgers.HostLedger(out, run, buckets.Geometry.of_manifest(MANIFEST, 32, 32, 1), host, hosts)


class _Reads:
    """Counts the storage layer's reads, existence checks and listings (and the listing of the markers)."""

    def __init__(self, monkeypatch):
        self.calls = []
        for module, name in ((storage, "read_bytes"), (storage, "exists"), (storage, "files"),
                             (inventory, "modified_times")):
            monkeypatch.setattr(module, name, self._counted(name, getattr(module, name)))

    def _counted(self, name, real):
        def call(*args, **kwargs):
            self.calls.append((name, args[0]))
            return real(*args, **kwargs)
        return call

    def markers_listed(self) -> bool:
        return any(name == "modified_times" for name, _ in self.calls)


def test_a_host_reads_its_ledger_and_a_marker_instead_of_listing_them_all(tmp_path, monkeypatch, caplog):
    out, run = _out(tmp_path)
    first = _host(out, run, 1)
    with caplog.at_level("INFO", logger="promptmill"):
        assert first.start() == {1, 3, 5}  # no ledger yet: listed, and written
    [fallback] = [r for r in caplog.records if r.getMessage() == "ledger_fallback"]
    assert fallback.fields["reason"] == "missing"
    first.add(7, 4, 1000.0)
    storage.write_json(naming.shard_stats(out, 7), {"slice": 7})  # (a real host writes the marker first)
    saved = storage.read_json(naming.ledger_file(out, 1))
    assert (saved["committed"], saved["slices"], saved["images"]) == ([[1, 7]], 4, 16)
    reads = _Reads(monkeypatch)
    assert _host(out, run, 1).start() == {1, 3, 5, 7}
    assert not reads.markers_listed() and len(reads.calls) <= 3, reads.calls  # its ledger and its newest marker


@pytest.mark.parametrize("change,reason", [
    ("hosts", "stale: another hosts (2; now 4)"),
    ("plan", "stale: another planned slices (10; now 11)"),
    ("marker", "disagrees with the markers: slice 5 has none"),
    ("garbage", "unreadable"),
])
def test_a_ledger_that_cannot_be_trusted_falls_back_to_the_listing_and_says_why(tmp_path, change, reason, caplog):
    out, run = _out(tmp_path)
    _host(out, run, 1).start()
    hosts, manifest = 2, MANIFEST
    if change == "hosts":
        hosts = 4
    elif change == "plan":
        manifest = {**MANIFEST, "slices": 11, "images": 42}
    elif change == "marker":  # its newest slice lost its marker: it is not committed, whatever the ledger says
        storage.delete([naming.shard_stats(out, 5)])
    else:
        storage.write_text(naming.ledger_file(out, 1), "{not json")
    host = ledgers.HostLedger(out, run, buckets.Geometry.of_manifest(manifest, 32, 32, 1), 1, hosts)
    caplog.clear()
    with caplog.at_level("INFO", logger="promptmill"):
        found = host.start()
    assert [r.fields["reason"] for r in caplog.records if r.getMessage() == "ledger_fallback"] == [reason]
    assert found == {index for index in runs.committed(out) if index % hosts == 1}
    assert 5 not in found or change != "marker"


def test_status_counts_from_the_ledgers_reading_o_hosts_objects_and_lists_the_markers_when_they_disagree(
        tmp_path, monkeypatch):
    out, run = _out(tmp_path)
    assert status.status(out)["committed"]["why_listed"].startswith("no ledgers")
    for host in range(2):
        _host(out, run, host).start()
    listed = status.status(out)["committed"]
    reads = _Reads(monkeypatch)
    r = status.status(out)
    found = r["committed"]
    assert (found["slices"], found["images"], found["counted_from"]) == (listed["slices"], listed["images"],
                                                                         "ledgers") == (5, 20, "ledgers")
    assert not reads.markers_listed()
    ledger_reads = [call for call in reads.calls if "ledger" in call[1] or "_stats.json" in call[1]]
    assert len(ledger_reads) == found["objects_read"] == 1 + 2 + 2 * 2, ledger_reads  # a listing, 2 ledgers, 4 markers
    # a commit whose ledger was not written (a host killed between the two): the markers are listed, and say so
    storage.write_json(naming.shard_stats(out, 4), {"slice": 4})
    behind = status.status(out)
    assert behind["committed"]["slices"] == 6 and behind["committed"]["counted_from"] == "listing"
    assert "host(s) [0]'s ledgers disagree with the markers" in status.format_text(behind)
    # a resumed host finds that slice by its marker and adds it to its ledger: counted from the ledgers again
    host = _host(out, run, 0)
    assert 4 not in host.start()
    host.add(4, 4)  # what the host loop does for a slot it finds committed
    assert status.status(out)["committed"] | {"objects_read": 0} == {**listed, "slices": 6, "images": 24,
                                                                      "objects_read": 0}


@pytest.mark.parametrize("hosts,who,why", [
    ([(0, 2, 1.0), (1, 2, 1.0)], None, None),
    ([(0, 2, 1.0)], None, "the ledgers of 2 hosts are not all there"),
    ([(0, 4, 5.0), (1, 4, 5.0), (2, 4, 5.0), (3, 4, 5.0), (0, 2, 1.0)], None, None),  # an older count: superseded
    ([(0, 2, 5.0), (1, 2, 5.0), (2, 4, 6.0), (3, 4, 6.0)], None, "the ledgers of 4 hosts are not all there"),
    ([(0, 1, 2.0), (1, 2, 3.0)], None, "the ledgers of 2 hosts are not all there"),
    ([(0, 2, 1.0), (1, 2, 1.0)], "run", "host 0's ledger is of another run or plan"),
])
def test_which_ledgers_make_one_set_to_count_from(hosts, who, why):
    run = Run.create(Settings(out="o", model="tiny", width=32, height=32, steps=3, scheduler="ddim",
                              per_device_batch=1, batches_per_slice=2, guided=True), "f" * 64, "2026", {})
    found = [ledgers.Ledger(host, count, "x" if who == "run" else run.settings_fingerprint, 10, (), updated_at=when)
             for host, count, when in hosts]
    assert ledgers.consistent(found, run, 10) == why


def test_a_beam_run_removes_the_ledgers_it_would_not_keep(tmp_path):
    out, run = _out(tmp_path)
    _host(out, run, 0).start()
    assert ledgers.forget(out) == 1 and storage.glob(naming.join(out, "ledger")) == []
    assert naming.owned("ledger/host-00000.json")  # --overwrite deletes them with the run


def test_the_ledgers_count_each_size_of_a_run_of_several_sizes_as_the_listing_does(tmp_path):
    out, run = _out(tmp_path, committed=(0, 1, 2, 4))
    sized = {**MANIFEST, "slices": 5, "images": 17, "buckets": [
        {"size": "32x32", "width": 32, "height": 32, "per_device_batch": 1, "slice_size": 4, "records": 9,
         "images": 9, "offset": 0, "first_slice": 0, "slices": 3},
        {"size": "32x48", "width": 32, "height": 48, "per_device_batch": 1, "slice_size": 4, "records": 8,
         "images": 8, "offset": 9, "first_slice": 3, "slices": 2}]}
    storage.write_json(naming.manifest(out), sized)
    listed = status.status(out)
    geometry = buckets.Geometry.of_manifest(sized, 32, 32, 1)
    for host in range(2):
        ledger = ledgers.HostLedger(out, run, geometry, host, 2)
        ledger.start()
    ledger.add(3, 4, 1.0)  # host 1 commits slice 3 (of the second size)
    storage.write_json(naming.shard_stats(out, 3), {"slice": 3})
    counted = status.status(out)
    assert counted["committed"]["counted_from"] == "ledgers" and listed["committed"]["counted_from"] == "listing"
    assert [(s["committed_slices"], s["committed_images"]) for s in listed["sizes"]] == [(3, 9), (1, 4)]
    assert [(s["committed_slices"], s["committed_images"]) for s in counted["sizes"]] == [(3, 9), (2, 8)]


def test_a_ledger_keeps_few_recent_commits_and_status_adds_up_each_hosts_rate(tmp_path):
    out, run = _out(tmp_path, committed=())
    hosts = [_host(out, run, host) for host in range(2)]
    for host in hosts:
        host.start()
    now = 10_000.0
    for index in range(200):  # each host commits a slice of 4 images a second for 100 s
        hosts[index % 2].add(index, 4, now - 100 + index // 2)
    assert all(len(host.ledger.recent) == ledgers.RECENT_MAX for host in hosts)
    found = ledgers.Committed(200, 800, (), tuple(host.ledger.recent for host in hosts), now, "ledgers")
    rate = status.report(out, run, {**MANIFEST, "slices": 300, "images": 1200}, found, [], dataset_stats=None,
                         now=now)["rate"]
    assert rate["images_per_s"] == pytest.approx(2 * 4 * 63 / 64, rel=0.01)  # two hosts, 4 images/s each
