"""Per-host ledgers: the slices each host has committed, so that no one lists every marker.

A commit marker (``shards/NNNNN_stats.json``) stays the truth of a committed slice, and
collect still checks every one. But a run of a billion images has a million of them,
and listing them costs a request per 1,000: minutes for every host at every start and for
every ``status``. So each pod host also keeps a ledger, ``ledger/host-NNNNN.json``: the
slices of its own slots that are committed, as runs of its stride (host h of H commits
h, h+H, h+2H, ...: a few numbers however many slices), their count and images (per size),
its commits of the last ``RECENT_S`` seconds, and what it belongs to (the run's settings
fingerprint, the planned slices, the hosts). GCS has no append: the host writes its
ledger whole after each commit marker, and it stays a few hundred bytes.

* A host starting (``HostLedger.start``) reads its own ledger and checks that the marker
  of its newest slice exists: a few objects, not a listing. A ledger that is missing,
  stale (another run, plan or host count) or that disagrees with the markers is not
  trusted: the host lists the markers as before (``ledger_fallback`` says why) and writes
  a fresh ledger from them. A slot that no ledger names is checked against its marker as
  always, so a ledger that lags (a host killed between a marker and its ledger) loses
  nothing, and nothing is skipped that was not committed.
* ``status`` and ``submit gke``'s progress poll (``committed``) read every host's ledger:
  O(hosts) objects. They count from the ledgers when these are one consistent set (one
  host count, every host's, this run's and plan's, none behind its markers, which a read
  of the marker after each host's newest slice shows), and list the markers otherwise,
  saying why (``Committed.note``).
* The beam engine's workers keep no ledger: a beam run removes the ledgers (``forget``),
  so nothing counts from ledgers that miss its commits.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.core import buckets, logs, naming
from pipeline.io import runs, storage

RECENT_S = 900.0  # commits a ledger keeps with their times: more than status's rate window
RECENT_MAX = 64  # and at most this many, the newest: a ledger stays small however short its slices
READERS = 16  # ledgers and markers read at once


# ---------------------------------------------------------------- runs of a stride (pure)

def add(found: list[list[int]], index: int, stride: int) -> list[list[int]]:
    """``found`` ([first, last] runs of ``stride``, sorted) with ``index`` added: a new list."""
    merged = sorted([*found, [index, index]])
    out: list[list[int]] = []
    for first, last in merged:
        if out and first <= out[-1][1] + stride and (first - out[-1][0]) % stride == 0:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return out


def contains(found, index: int) -> bool:
    """Whether the runs hold ``index`` (of their stride's residue)."""
    return any(first <= index <= last for first, last in found)


def indices(found: list[list[int]], stride: int) -> set[int]:
    """Every slice the runs hold."""
    return {i for first, last in found for i in range(first, last + 1, stride)}


def runs_of(slices, stride: int) -> list[list[int]]:
    """Runs of ``stride`` holding exactly ``slices`` (all of one residue mod ``stride``)."""
    out: list[list[int]] = []
    for index in sorted(slices):
        if out and index == out[-1][1] + stride:
            out[-1][1] = index
        else:
            out.append([index, index])
    return out


# ---------------------------------------------------------------- one ledger

@dataclasses.dataclass(frozen=True)
class Ledger:
    """``ledger/host-NNNNN.json``: host ``host`` of ``hosts``'s committed slices of a run."""
    host: int
    hosts: int
    settings_fingerprint: str
    planned: int  # the plan's slices
    committed: tuple  # runs [first, last] of stride ``hosts``
    slices: int = 0
    images: int = 0
    by_size: tuple = ()  # (slices, images) per size, in a run of several sizes
    recent: tuple = ()  # (committed_ts, images) of its newest commits of the last RECENT_S seconds
    last_at: float | None = None
    updated_at: float = 0.0

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "committed": [list(r) for r in self.committed],
                "by_size": [list(s) for s in self.by_size], "recent": [list(r) for r in self.recent]}

    @classmethod
    def from_json(cls, found: dict) -> "Ledger":
        return cls(**{**found, "committed": tuple(tuple(r) for r in found["committed"]),
                      "by_size": tuple(tuple(s) for s in found.get("by_size", ())),
                      "recent": tuple(tuple(r) for r in found.get("recent", ()))})

    def newest(self) -> int | None:
        return max((last for _, last in self.committed), default=None)


def read(out: str, host: int) -> tuple[Ledger | None, str | None]:
    """(host ``host``'s ledger, None), or (None, "missing" or "unreadable")."""
    path = naming.ledger_file(out, host)
    if not storage.exists(path):
        return None, "missing"
    ledger = _read_path(path)
    return ledger, None if ledger is not None else "unreadable"


def stale(ledger: Ledger, run, planned: int, host: int, hosts: int) -> str | None:
    """Why ``ledger`` is not this host's ledger of this run's plan, or None (pure)."""
    for what, theirs, ours in (("run", ledger.settings_fingerprint, run.settings_fingerprint),
                               ("planned slices", ledger.planned, planned), ("hosts", ledger.hosts, hosts),
                               ("host", ledger.host, host)):
        if theirs != ours:
            return f"stale: another {what} ({theirs}; now {ours})"
    return None


class HostLedger:
    """A pod host's ledger while it runs: ``start`` finds its committed slices, ``add``
    records each commit after its marker (the ledger written whole)."""

    def __init__(self, out: str, run, geometry: buckets.Geometry, host: int, hosts: int):
        self.out, self.run, self.geometry, self.host, self.hosts = out, run, geometry, host, hosts
        self.ledger: Ledger | None = None
        # the host loop adds a slot found committed while the committer thread adds a commit
        self._lock = threading.Lock()

    def start(self) -> set[int]:
        """This host's committed slices: from its ledger when it can be trusted (a few
        reads), else from one listing of the markers, logged as ``ledger_fallback``. Writes
        the ledger it will add to."""
        planned = self.geometry.slices
        ledger, why = read(self.out, self.host)
        why = why or stale(ledger, self.run, planned, self.host, self.hosts)
        if why is None and ledger.newest() is not None and not storage.exists(
                naming.shard_stats(self.out, ledger.newest())):
            why = f"disagrees with the markers: slice {ledger.newest()} has none"
        if why is None:
            logs.event("ledger_read", host=self.host, committed=ledger.slices)
            self.ledger = ledger
            return indices(ledger.committed, self.hosts)
        mine = {index for index in runs.committed(self.out) if index < planned and index % self.hosts == self.host}
        logs.event("ledger_fallback", level=logging.WARNING, host=self.host, reason=why, committed=len(mine),
                   message=f"host {self.host}'s ledger is {why}: its committed slices were listed instead")
        self.ledger = self._counted(mine, ())
        self._write()
        return mine

    def _counted(self, committed, recent) -> Ledger:
        sizes = [[0, 0] for _ in self.geometry.buckets]
        for index in committed:
            b = self.geometry.bucket_of_slice(index)
            sizes[b][0] += 1
            sizes[b][1] += self.geometry.slice_images(index)
        last = max((t for t, _ in recent), default=None)
        return Ledger(self.host, self.hosts, self.run.settings_fingerprint, self.geometry.slices,
                      tuple(tuple(r) for r in runs_of(committed, self.hosts)), len(committed),
                      sum(n for _, n in sizes), tuple(tuple(s) for s in sizes) if len(sizes) > 1 else (),
                      tuple(recent), last, time.time())

    def add(self, index: int, images: int, committed_ts: float | None = None) -> None:
        """Record slice ``index`` of ``images`` images, committed at ``committed_ts`` (a commit
        of this attempt), or found committed by its marker (None). Written whole at once: a
        failed write is logged, and the next one catches up."""
        with self._lock:
            self._add(index, images, committed_ts)

    def _add(self, index: int, images: int, committed_ts: float | None) -> None:
        ledger = self.ledger
        if contains(ledger.committed, index):
            return
        now = time.time() if committed_ts is None else committed_ts
        recent = tuple((t, n) for t, n in ledger.recent if t >= now - RECENT_S)[-(RECENT_MAX - 1):]
        sizes = [list(s) for s in ledger.by_size]
        if sizes:
            b = self.geometry.bucket_of_slice(index)
            sizes[b] = [sizes[b][0] + 1, sizes[b][1] + images]
        self.ledger = dataclasses.replace(
            ledger, committed=tuple(tuple(r) for r in add([list(r) for r in ledger.committed], index, self.hosts)),
            slices=ledger.slices + 1, images=ledger.images + images, by_size=tuple(tuple(s) for s in sizes),
            recent=recent + (((now, images),) if committed_ts is not None else ()),
            last_at=ledger.last_at if committed_ts is None else max(now, ledger.last_at or now), updated_at=time.time())
        self._write()

    def _write(self) -> None:
        try:
            storage.write_json(naming.ledger_file(self.out, self.host), self.ledger.to_json())
        except Exception as e:  # noqa: BLE001 - the markers stay the truth: a resume or status lists them
            logs.event("ledger_not_written", level=logging.WARNING, host=self.host, error=f"{type(e).__name__}: {e}")


def forget(out: str) -> int:
    """Remove every ledger of ``out`` (a run whose commits keep none, as the beam engine's);
    returns how many."""
    found = sorted(storage.files(naming.ledger_dir(out), "*.json"))
    if found:
        storage.delete(found)
        logs.event("ledgers_removed", out=out, ledgers=len(found),
                   why="the beam engine's workers keep no ledger: status and hosts list the markers")
    return len(found)


# ---------------------------------------------------------------- what is committed

@dataclasses.dataclass(frozen=True)
class Committed:
    """A run's committed slices as status counts them: from the ledgers, or from a listing."""
    slices: int
    images: int
    by_size: tuple  # (slices, images) per size of a run of several sizes
    # the recent commits, (commit time, images), in groups whose rates add up (status's rate):
    # one group a host from the ledgers, one group of every marker from a listing
    recent: tuple
    last_at: float | None
    source: str  # "ledgers" or "listing"
    note: str | None = None  # why the markers were listed
    objects_read: int = 0  # ledgers and markers read (a listing counts its pages)


def from_times(times: dict[int, float], manifest: dict | None, note: str | None = None,
               read: int = 0) -> Committed:
    """A ``Committed`` from the commit markers' times ({slice: unix seconds}) of a plan (pure);
    slices beyond the plan are not counted."""
    if not manifest:
        return Committed(0, 0, (), (), None, "listing", note, read)
    geometry = buckets.Geometry.of_manifest(manifest, 0, 0, 0)
    times = {i: t for i, t in times.items() if i < geometry.slices}
    sizes = [[0, 0] for _ in geometry.buckets]
    recent = []
    last = max(times.values(), default=0.0)
    for index, when in times.items():
        n = geometry.slice_images(index)
        b = geometry.bucket_of_slice(index)
        sizes[b] = [sizes[b][0] + 1, sizes[b][1] + n]
        if when >= last - RECENT_S:
            recent.append((when, n))
    return Committed(len(times), sum(n for _, n in sizes), tuple(map(tuple, sizes)) if len(sizes) > 1 else (),
                     (tuple(recent),), max(times.values(), default=None), "listing", note, read)


def _from_listing(out: str, manifest: dict, note: str, read: int) -> Committed:
    times = runs.committed(out)
    return from_times(times, manifest, note, read + 1 + len(times) // 1000)  # a listing page per 1,000


def committed(out: str, run, manifest: dict) -> Committed:
    """What ``out`` has committed of its plan: from the hosts' ledgers when they are one
    consistent, current set (O(hosts) objects), else from a listing of the markers, with
    the reason in ``note``."""
    paths = sorted(storage.files(naming.ledger_dir(out), "host-*.json"))
    if not paths:
        return _from_listing(out, manifest, "no ledgers (a run by the beam engine, or hosts not started)", 1)
    with ThreadPoolExecutor(READERS, thread_name_prefix="ledgers") as pool:
        found = [ledger for ledger in pool.map(_read_path, paths) if ledger is not None]
        read = 1 + len(paths)
        why = consistent(found, run, manifest["slices"])
        if why is None:
            behind = [ledger.host for ledger, ok in zip(found, pool.map(lambda ledger: _current(out, ledger), found))
                      if not ok]
            read += 2 * len(found)
            why = f"host(s) {behind[:10]}'s ledgers disagree with the markers" if behind else None
    if why is not None:
        return _from_listing(out, manifest, why, read)
    sizes = [list(map(sum, zip(*[ledger.by_size[b] for ledger in found]))) for b in range(len(found[0].by_size))]
    return Committed(sum(ledger.slices for ledger in found), sum(ledger.images for ledger in found),
                     tuple(map(tuple, sizes)), tuple(ledger.recent for ledger in found),
                     max((ledger.last_at for ledger in found if ledger.last_at), default=None), "ledgers",
                     None, read)


def _read_path(path: str) -> Ledger | None:
    try:
        return Ledger.from_json(storage.read_json(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def consistent(found: list[Ledger], run, planned: int) -> str | None:
    """Why ``found`` is no set to count from, or None: each of ``hosts`` hosts' ledger, of
    this run and plan, one host count; ledgers of another host count all older (pure)."""
    if not found:
        return "no readable ledger"
    newest = max(found, key=lambda ledger: ledger.updated_at)
    current = [ledger for ledger in found if ledger.hosts == newest.hosts]
    older = [ledger for ledger in found if ledger.hosts != newest.hosts]
    if sorted(ledger.host for ledger in current) != list(range(newest.hosts)):
        return f"the ledgers of {newest.hosts} hosts are not all there"
    if older and max(ledger.updated_at for ledger in older) > min(ledger.updated_at for ledger in current):
        return "ledgers of two host counts overlap"
    for ledger in current:
        if ledger.settings_fingerprint != run.settings_fingerprint or ledger.planned != planned:
            return f"host {ledger.host}'s ledger is of another run or plan"
    return None


def _current(out: str, ledger: Ledger) -> bool:
    """Whether the markers agree with ``ledger`` where it matters: its newest slice has one,
    and the next slice of its host has none (the ledger is not behind)."""
    newest = ledger.newest()
    if newest is not None and not storage.exists(naming.shard_stats(out, newest)):
        return False
    following = ledger.host if newest is None else newest + ledger.hosts
    return following >= ledger.planned or not storage.exists(naming.shard_stats(out, following))
