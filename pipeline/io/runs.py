"""``OUT/run.json``: the one place a planned run's settings are read and written."""
from __future__ import annotations

from pipeline.core import naming
from pipeline.core.settings import Run
from pipeline.io import storage


class RunNotPlanned(ValueError):
    pass


class OtherLayout(ValueError):
    """A run made with another output layout than this version's (``naming.LAYOUT``)."""


def check_layout(out: str, run: Run) -> Run:
    """``run``, or OtherLayout naming its layout and what to do: this version neither reads
    nor finishes a run of another layout, and changes nothing of it."""
    if run.layout == naming.LAYOUT:
        return run
    made_by = dict(run.versions).get("promptmill", "unknown")
    when = "an earlier" if run.layout < naming.LAYOUT else "a later"
    raise OtherLayout(f"{out} holds a run made with output layout {run.layout} (by promptmill {made_by}), "
                      f"{when} layout than this version's ({naming.LAYOUT}); this version does not read or "
                      f"finish it, and changed nothing in it. Finish it with the promptmill that made it (version "
                      f"{made_by}, writing layout {run.layout}), or start again with --overwrite (which deletes "
                      f"that run) or another --out")


def exists(out: str) -> bool:
    return storage.exists(naming.run_json(out))


def read(out: str, any_layout: bool = False) -> Run:
    """The run planned in ``out``; RunNotPlanned if there is none, OtherLayout if it was made
    with another output layout (``check_layout``), unless ``any_layout`` (``--overwrite``,
    which only needs to know that a promptmill run is there)."""
    path = naming.run_json(out)
    if not storage.exists(path):
        raise RunNotPlanned(f"{path} does not exist: run 'promptmill plan' for this --out first")
    try:
        run = Run.from_dict(storage.read_json(path))
    except (KeyError, TypeError, ValueError) as e:
        raise RunNotPlanned(f"{path} is not a promptmill run.json: {e}") from e
    return run if any_layout else check_layout(out, run)


def write(out: str, run: Run) -> None:
    storage.write_json(naming.run_json(out), run.to_dict())


def committed(out: str) -> dict[int, float]:
    """{slice: when its commit marker was written, unix seconds} of every committed slice of
    ``out``, from one listing of ``OUT/shards`` (no marker is read)."""
    found = {}
    for path, when in storage.modified_times(naming.join(out, "shards"), "_stats.json").items():
        index = naming.marker_slice(path)
        if index is not None and path == naming.shard_stats(out, index):
            found[index] = when
    return found
