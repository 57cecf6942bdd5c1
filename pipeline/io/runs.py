"""``OUT/run.json``: the one place a planned run's settings are read and written."""
from __future__ import annotations

from pipeline.core import naming
from pipeline.core.settings import Run
from pipeline.io import storage


class RunNotPlanned(ValueError):
    pass


def exists(out: str) -> bool:
    return storage.exists(naming.run_json(out))


def read(out: str) -> Run:
    """The run planned in ``out``; RunNotPlanned if there is none."""
    path = naming.run_json(out)
    if not storage.exists(path):
        raise RunNotPlanned(f"{path} does not exist: run 'promptmill plan' for this --out first")
    try:
        return Run.from_dict(storage.read_json(path))
    except (KeyError, TypeError, ValueError) as e:
        raise RunNotPlanned(f"{path} is not a promptmill run.json: {e}") from e


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
