"""``OUT/run.json``: the one place a planned run's settings are read and written."""
from __future__ import annotations

from pipeline.core import naming
from pipeline.core.settings import SETTINGS_VERSION, Run
from pipeline.io import inventory, storage


class RunNotPlanned(ValueError):
    pass


class OtherVersion(ValueError):
    """A run made by a promptmill whose output layout or settings' meaning this version's
    are not (``naming.LAYOUT``, ``settings.SETTINGS_VERSION``)."""



def check_versions(out: str, data: dict) -> None:
    """OtherVersion naming the version of ``data`` (a run.json document) that is not this
    promptmill's, and what to do: this version neither reads nor finishes such a run, and
    changes nothing of it."""
    made_by = (data.get("versions") or {}).get("promptmill", "unknown")
    found = [(what, short, data.get(name, 1), ours) for what, short, name, ours in (
        ("output layout", "layout", "layout", naming.LAYOUT),
        ("settings version", "settings version", "settings_version", SETTINGS_VERSION)) if data.get(name, 1) != ours]
    if not found:
        return
    what, short, theirs, ours = found[0]
    when = "an earlier" if theirs < ours else "a later"
    raise OtherVersion(f"{out} holds a run made with {what} {theirs} (by promptmill {made_by}), {when} {short} than "
                       f"this version's ({ours}); this version does not read or finish it, and changed nothing in "
                       f"it. Finish it with the promptmill that made it (version {made_by}), or start again with "
                       f"--overwrite (which deletes that run) or another --out")


def exists(out: str) -> bool:
    return storage.exists(naming.run_json(out))


def read(out: str) -> Run:
    """The run planned in ``out``; RunNotPlanned if there is none, OtherVersion if it was made
    with another output layout or settings version (``check_versions``)."""
    data = read_document(out)
    try:
        return Run.from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise RunNotPlanned(f"{naming.run_json(out)} is not a promptmill run.json: {e}") from e


def read_document(out: str, any_version: bool = False) -> dict:
    """``out``'s run.json as a document, checked as ``read`` does (``any_version``: not its
    versions; ``--overwrite`` only needs to know that a promptmill run is there)."""
    path = naming.run_json(out)
    if not storage.exists(path):
        raise RunNotPlanned(f"{path} does not exist: run 'promptmill plan' for this --out first")
    try:
        data = storage.read_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("settings"), dict) or "model_fingerprint" not in data:
            raise ValueError("it has no settings and model fingerprint")
    except ValueError as e:
        raise RunNotPlanned(f"{path} is not a promptmill run.json: {e}") from e
    if not any_version:
        check_versions(out, data)
    return data


def write(out: str, run: Run) -> None:
    storage.write_json(naming.run_json(out), run.to_dict())


def committed(out: str) -> dict[int, float]:
    """{slice: when its commit marker was written, unix seconds} of every committed slice of
    ``out``, from one listing of ``OUT/shards`` (no marker is read)."""
    found = {}
    for path, when in inventory.modified_times(naming.join(out, "shards"), "_stats.json").items():
        index = naming.marker_slice(path)
        if index is not None and path == naming.shard_stats(out, index):
            found[index] = when
    return found
