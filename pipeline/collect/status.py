"""``promptmill status OUT``: where a run stands, from any machine, for OUT local or gs://.

It reads run.json, the plan manifest, the hosts' progress objects
(``pipeline.generate.progress``), the hosts' ledgers of their committed slices
(``pipeline.io.ledgers``: O(hosts) objects, however many slices) and, once collect has
run, ``dataset/stats.json``. Where the ledgers are not one consistent, current set (a run
of the beam engine, hosts of an older version, a host killed between its marker and its
ledger), it lists the commit markers instead (one listing of ``OUT/shards``: names and
times, no marker is read), and says why. It never reads an image, a metadata shard or a
plan slice.

From those it reports (``report``, pure): the settings in one line; slices and images
committed out of planned (a committed slice holds ``slice_size`` images, the last slice
the rest); rejects; the rate over the last ``RATE_WINDOW_S`` seconds of commit markers
and an ETA; each host's state, last event and when; the slices hosts redid, and hosts
that failed; and whether collect has run and verified.
"""
from __future__ import annotations

import datetime as dt
import os
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.core import buckets, filters, interrupts, logs, naming
from pipeline.core.numbers import counted
from pipeline.core.settings import Run, guided_by_records_line
from pipeline.generate import progress as progress_lib
from pipeline.io import ledgers, runs, storage
from pipeline.model import families

RATE_WINDOW_S = 600.0  # the rate is over the commits of the last ten minutes
STALE_AFTER_S = 12 * progress_lib.INTERVAL_S  # a running host's progress older than this: it stopped writing
MAX_LISTED = 20  # slice indices shown per list
_HOST_LOG = re.compile(r"host-(\d+)\.log")


def slice_images(index: int, manifest: dict) -> int:
    """Images in slice ``index``: its size's ``slice_size``, the last slice of each size the
    remainder (pure)."""
    return buckets.manifest_slice_images(manifest, index)


def settings_line(run: Run, planned: bool = True) -> str:
    """A run's settings in one line (pure). Until the run is ``planned`` (its manifest
    written), the plan may still decide settings (guidance, a capped batch), and so the
    fingerprint, which is then left out."""
    s = run.settings
    size = f"{s.width}x{s.height}" if s.width and s.height else "native size"
    if s.sizes:
        size = f"sizes={','.join(s.sizes)}"
    parts = [f"model={s.model}", size, f"steps={s.steps}", f"scheduler={s.scheduler}"]
    if s.timestep_spacing:
        parts.append(f"spacing={s.timestep_spacing}")
    guidance = "the family's" if s.guidance_scale is None else f"{s.guidance_scale:g}"
    shown = families.guidance_rule(s.guidance_rule).shown
    kind = shown if shown is not None else "" if s.guided is not False else " (guidance-free)"
    if s.max_sequence_length is not None:
        parts.append(f"text_tokens={s.max_sequence_length}")  # T5's for FLUX.1, Qwen3's for others
    if s.fsdp != 1:
        parts.append(f"fsdp={s.fsdp}")
    parts += [f"guidance={guidance}{kind}",
              f"dtype={s.dtype}", f"batch={'/'.join(map(str, s.bucket_batches)) or s.per_device_batch}/device",
              f"devices/host={s.devices_per_host}", f"slice={_slice_sizes(s)}", f"formats={','.join(s.formats)}",
              f"image={s.image_format}",
              f"seed={s.seed}"]
    if s.scores:
        parts.append(f"scores={','.join(s.scores)}")
    rules = filters.active_rules(s)
    if rules:
        parts.append("filters=" + ",".join(f"{rule}" if rule == "drop_nsfw" else f"{rule}>={getattr(s, rule):g}"
                                           .replace("min_", "") for rule in rules))
    if s.unet:
        parts.append(f"unet={s.unet}")
    if s.loras:
        parts.append(f"loras={len(s.loras)}")
    return " ".join(parts) + (f" [fingerprint {run.settings_fingerprint[:12]}]" if planned else
                              " [fingerprint: once planned]")


def _slice_sizes(s) -> str:
    """The slice size, or each size's (a run of several sizes: "8/8/4"); "auto" until the
    plan under way decides it."""
    try:
        if not s.sizes:
            return str(s.slice_size)
        try:
            return "/".join(str(s.for_bucket(i).slice_size) for i in range(len(s.sizes)))
        except ValueError:  # the sizes not resolved yet (a plan under way)
            return str(s.slice_size)
    except ValueError:
        return "auto"


def size_progress(manifest: dict | None, committed: ledgers.Committed) -> list[dict]:
    """[{size, slices, committed_slices, images, committed_images, slice_size}] of each size of
    a plan of several sizes, from its manifest and what is committed of each; [] for one
    size (pure)."""
    if not manifest or not manifest.get("buckets"):
        return []
    done = committed.by_size or [(0, 0)] * len(manifest["buckets"])
    return [{"size": bucket["size"], "slices": bucket["slices"], "committed_slices": slices, "images": bucket["images"],
             "committed_images": images, "slice_size": bucket["slice_size"]}
            for bucket, (slices, images) in zip(manifest["buckets"], done)]


def commit_rate(times: list[float], images: list[int], now: float, window_s: float = RATE_WINDOW_S) \
        -> float | None:
    """Images per second committed over the last ``window_s`` seconds (pure), from the
    commit times of slices and their images: the images committed after the window's
    first commit, over the time from it to now (so a run that stalls slows down). None
    with fewer than two commits in the window."""
    recent = sorted((t, n) for t, n in zip(times, images) if now - window_s <= t <= now + 60)
    if len(recent) < 2 or now <= recent[0][0]:
        return None
    return sum(n for _, n in recent[1:]) / (now - recent[0][0])


def host_view(p: dict, now: float) -> dict:
    """One host's line of the report, from its progress object (pure)."""
    running = p.get("state") not in progress_lib.FINAL
    age = now - p["updated_at"] if p.get("updated_at") else None
    return {"name": p.get("name"), "host": p.get("host"), "state": p.get("state"),
            "stale": bool(running and age is not None and age > STALE_AFTER_S),
            "last_event": p.get("last_event"), "last_event_at": p.get("last_event_at"),
            "last_event_age_s": round(now - p["last_event_at"], 1) if p.get("last_event_at") else None,
            "updated_age_s": round(age, 1) if age is not None else None, "slices": p.get("slices", 0),
            "images": p.get("images", 0), "images_per_s": p.get("images_per_s"), "last_slice": p.get("last_slice"),
            "skipped": p.get("skipped", 0), "redone": p.get("redone", 0), "failure": p.get("failure"),
            "machine": p.get("machine"), "pid": p.get("pid")}


def run_state(committed: int, planned: int, hosts: list[dict], collect: dict) -> str:
    """One word for the run (pure): collected, generated, failed, stopped, generating or idle."""
    if collect["ran"]:
        return "collected" if collect["verified"] else "collected_unverified"
    if planned and committed >= planned:
        return "generated"
    live = [h for h in hosts if h["state"] not in progress_lib.FINAL and not h["stale"]]
    if live:
        return "generating"
    if any(h["state"] == "failed" for h in hosts):
        return "failed"
    if any(h["state"] in ("stopped", "killed") for h in hosts):
        return "stopped"
    return "idle"


def report(out: str, run: Run, manifest: dict | None, committed: ledgers.Committed, progress: list[dict], *,
           dataset_stats: dict | None, now: float, host_logs: frozenset[int] = frozenset()) -> dict:
    """The status of the run in ``out`` (pure) at ``now``, from what ``gather`` read
    (``dataset_stats``: collect's, None until it ran); ``host_logs``: the hosts whose log a
    local run keeps in ``OUT/logs``."""
    planned_slices = manifest["slices"] if manifest else 0
    images = committed.images
    rates = [commit_rate([t for t, _ in group], [n for _, n in group], now) for group in committed.recent]
    rate = sum(r for r in rates if r is not None) if any(r is not None for r in rates) else None
    hosts = sorted((host_view(p, now) for p in progress), key=lambda h: (h["host"] is None, h["host"], h["name"]))
    for h in hosts:  # a local run's launcher keeps each host's log under OUT
        h["log"] = naming.host_log(naming.logs_dir(out), h["host"]) if h["host"] in host_logs else None
    collect = {"ran": dataset_stats is not None,
               "verified": dataset_stats.get("verified") if dataset_stats else None,
               "images": dataset_stats.get("images") if dataset_stats else None,
               "dropped": (dataset_stats.get("dropped") or {}).get("images", 0) if dataset_stats else None,
               "problems": {kind: v["count"] for kind, v in dataset_stats.get("problems", {}).items()}
               if dataset_stats else {}}
    state = run_state(committed.slices, planned_slices, hosts, collect) if manifest else "planning"
    remaining = (manifest["images"] - images) if manifest else None
    eta = remaining / rate if rate and remaining and state == "generating" else None
    redone = sorted({i for p in progress for i in p.get("redone_slices", []) if i is not None})
    expected = max([p["hosts"] for p in progress if isinstance(p.get("hosts"), int)], default=0)
    never = sorted(set(range(expected)) - {h["host"] for h in hosts})
    return {
        "out": out, "state": state, "settings": settings_line(run, manifest is not None),
        "settings_fingerprint": run.settings_fingerprint if manifest else None,
        "planned": {"slices": planned_slices, "images": manifest["images"] if manifest else None,
                    "records": manifest["records"] if manifest else None},
        "committed": {"slices": committed.slices, "images": images,
                      "last_at": round(committed.last_at, 3) if committed.last_at is not None else None,
                      "counted_from": committed.source, "why_listed": committed.note,
                      "objects_read": committed.objects_read},
        "sizes": size_progress(manifest, committed),
        "guided_by_records": manifest.get("guided_by_records") if manifest else None,
        "rejects": {"count": manifest["rejects"] if manifest else None,
                    "by_reason": manifest.get("rejects_by_reason", {}) if manifest else {}},
        "rate": {"images_per_s": round(rate, 3) if rate is not None else None, "window_s": RATE_WINDOW_S,
                 "eta_s": round(eta, 1) if eta is not None else None},
        "hosts": hosts,
        "never_started": [{"host": i, "log": naming.host_log(naming.logs_dir(out), i) if i in host_logs else None}
                          for i in never],
        "redone_slices": redone,
        "failed_hosts": [{"name": h["name"], "failure": h["failure"]} for h in hosts if h["state"] == "failed"],
        "collect": collect,
        "checked_at": round(now, 3),
    }


def _read_json(path: str):
    """The object's JSON, or None when it does not exist."""
    return storage.read_json(path) if storage.exists(path) else None


def _read_progress(path: str) -> dict | None:
    """A progress object, or None when it cannot be read now: a local one is rewritten in
    place every few seconds (GCS replaces objects whole), so it may be caught half-written."""
    try:
        found = storage.read_json(path)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def gather(out: str) -> tuple[Run, dict | None, ledgers.Committed, list[dict], dict | None, frozenset[int]]:
    """What ``report`` needs, read from ``out``: run.json (RunNotPlanned if there is
    none), the manifest (None while planning), what is committed (``ledgers.committed``),
    the progress objects, collect's stats (None until it ran), and the hosts whose log is
    under OUT (a local run's; those of a gs:// run are not)."""
    run = runs.read(out)
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="status") as pool:
        manifest = pool.submit(_read_json, naming.manifest(out))
        stats = pool.submit(_read_json, naming.dataset_file(out, "stats.json"))
        paths = sorted(storage.files(naming.progress_dir(out), "*.json"))
        progress = [p for p in pool.map(_read_progress, paths) if p is not None]
        manifest = manifest.result()
        committed = ledgers.committed(out, run, manifest) if manifest else ledgers.from_times({}, None)
        return run, manifest, committed, progress, stats.result(), _local_host_logs(out)


def _local_host_logs(out: str) -> frozenset[int]:
    """The hosts whose log a local run's launcher keeps in ``OUT/logs`` (none on gs://)."""
    folder = naming.logs_dir(out)
    if storage.is_gcs(out) or not os.path.isdir(folder):
        return frozenset()
    return frozenset(int(match.group(1)) for match in map(_HOST_LOG.fullmatch, os.listdir(folder)) if match)


def status(out: str) -> dict:
    """The status of the run in ``out`` now, with how long reading it took (``seconds``)."""
    watch = logs.Stopwatch()
    run, manifest, committed, progress, stats, host_logs = gather(out)
    return {**report(out, run, manifest, committed, progress, dataset_stats=stats, now=time.time(),
                     host_logs=host_logs),
            "seconds": round(watch.seconds(), 3)}


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _span(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _listed(indices: list[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:MAX_LISTED])
    return shown + (f" (and {len(indices) - MAX_LISTED} more)" if len(indices) > MAX_LISTED else "")


def format_text(r: dict) -> str:
    """``report`` for a terminal (pure)."""
    when = dt.datetime.fromtimestamp(r["checked_at"], dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"promptmill status {r['out']}  ({when}" + (f", read in {r['seconds']:.1f} s)" if "seconds" in r
                                                           else ")"),
             f"  settings  {r['settings']}",
             f"  state     {r['state']}"]
    planned, committed = r["planned"], r["committed"]
    if planned["images"] is None:
        lines.append("  plan      not written yet (the plan is running or failed)")
    else:
        share = 100 * committed["slices"] / planned["slices"] if planned["slices"] else 100.0
        lines.append(f"  slices    {committed['slices']}/{planned['slices']} committed ({share:.0f}%); "
                     f"images {committed['images']}/{planned['images']}")
        if committed.get("why_listed"):
            lines.append(f"  counted   from a listing of the commit markers: {committed['why_listed']}")
        for n, size in enumerate(r.get("sizes", [])):
            lines.append(f"  {'sizes' if n == 0 else '':<10}{size['size']}: {size['committed_slices']}/{size['slices']}"
                         f" slices, images {size['committed_images']}/{size['images']} (slice {size['slice_size']})")
        by_reason = ", ".join(f"{k}: {v}" for k, v in sorted(r["rejects"]["by_reason"].items()))
        lines.append(f"  rejects   {r['rejects']['count']}" + (f" ({by_reason})" if by_reason else ""))
        if r.get("guided_by_records"):
            lines.append(f"  guidance  {guided_by_records_line(r['guided_by_records'])}")
    rate = r["rate"]
    if rate["images_per_s"] is None:  # a rate needs two commits in the window
        last = committed["last_at"]
        recent = last is not None and r["checked_at"] - last <= rate["window_s"]
        lines.append(f"  rate      {'too few commits' if recent else 'no commits'} in the last "
                     f"{_span(rate['window_s'])}{' to measure a rate' if recent else ''}"
                     + (f" (last commit {_ago(r['checked_at'] - last)})" if last else ""))
    else:
        eta = f"; ETA {_span(rate['eta_s'])}" if rate["eta_s"] is not None else ""
        lines.append(f"  rate      {rate['images_per_s']:.3g} images/s over the last {_span(rate['window_s'])}{eta}")
    if not r["hosts"]:
        lines.append("  hosts     no progress objects yet")
    for k, h in enumerate(r["hosts"]):
        label = f"host {h['host']}" if h["host"] is not None else h["name"]
        state = h["state"] + (" (stale: no update " + _ago(h["updated_age_s"]) + ")" if h["stale"] else "")
        rate_h = f", {h['images_per_s']:.3g} images/s" if h["images_per_s"] else ""
        log = f"; log {h['log']}" if h.get("log") else ""
        last = f"{h['last_event']} {_ago(h['last_event_age_s'])}" if h["last_event"] else "no event yet"
        if h["stale"] and h["state"] == "starting":
            state = f"stopped while starting, before its first event (no update {_ago(h['updated_age_s'])})"
        lines.append(f"  {'hosts' if k == 0 else '':8}  {label}: {state}; {last}; "
                     f"{counted(h['slices'], 'slice')}, {counted(h['images'], 'image')} this attempt{rate_h}{log}")
    for n in r.get("never_started", []):
        why = f"see its log {n['log']}" if n["log"] else "no progress object: it never reached its first step"
        lines.append(f"  {'hosts' if not r['hosts'] else '':8}  host {n['host']}: never started ({why})")
    if r["redone_slices"]:
        lines.append(f"  redone    slices {_listed(r['redone_slices'])} (left half-written by an earlier attempt)")
    for f in r["failed_hosts"]:
        lines.append(f"  failed    {f['name']}: {f['failure']}")
    c = r["collect"]
    if not c["ran"]:
        lines.append("  collect   not run")
    elif c["verified"]:
        dropped = f", {c['dropped']} dropped by filters" if c.get("dropped") else ""
        lines.append(f"  collect   verified: {counted(c['images'], 'image')}{dropped}")
    else:
        problems = ", ".join(f"{k}: {v}" for k, v in sorted(c["problems"].items())) or "conservation failed"
        lines.append(f"  collect   ran, NOT verified ({problems})")
    return "\n".join(lines)


def watch(out: str, every_s: float, as_json: bool, emit=print, sleep=time.sleep, rounds: int | None = None) -> None:
    """Print the status every ``every_s`` seconds (``rounds`` times; None: until Ctrl-C). In
    a terminal the text report replaces the previous one; ``as_json`` prints one object
    a line."""
    import json

    if not every_s > 0:
        raise ValueError(f"--watch takes a positive number of seconds, got {every_s!r}")
    clear = not as_json and sys.stdout.isatty() and os.environ.get("TERM") != "dumb"
    done = 0
    try:
        while rounds is None or done < rounds:
            try:
                r = status(out)
                text = json.dumps(r, sort_keys=True) if as_json else format_text(r)
            except runs.RunNotPlanned:  # started before the run: wait for its run.json
                r = {"out": out, "state": "not_planned", "checked_at": round(time.time(), 3)}
                text = (json.dumps(r, sort_keys=True) if as_json else
                        f"promptmill status {out}\n  state     not planned yet: no run.json; waiting for a run "
                        f"(checking every {every_s:g} s)")
            emit(("\x1b[H\x1b[2J" if clear else "") + text + ("" if as_json or clear else "\n"))
            done += 1
            if rounds is None or done < rounds:
                sleep(every_s)
    except KeyboardInterrupt as e:  # Ctrl-C is the way out of --watch; SIGTERM still ends it as a stop
        if interrupts.signal_of(e) != signal.SIGINT:
            raise
