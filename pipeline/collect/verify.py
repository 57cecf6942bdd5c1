"""Verification of one slice, without Beam: every key's verdict from what the plan put in
the slice and what the slice's commit wrote (``pipeline.collect.parts`` runs it per slice).

  ok          planned once, one metadata row of this run, and its image file (when the
              run writes files) of the size (and, where the store lists one, the md5)
              its row recorded
  dropped     planned once, one metadata row of this run whose ``dropped`` reason says a
              filter kept the image out, and no image file (it is accounted for)
  missing     planned, but no row or no image file
  duplicated  planned more than once, or more than one row
  unexpected  a row or image file that was never planned in this slice, or an image file
              of an image a filter dropped
  other_run   one row, but with another settings fingerprint than run.json's: a row of
              another run (a mixed OUT), whatever the cause
  foreign     one row of this run, but made in another environment than the run's (its
              ``environment`` is not OUT/environment.json's fingerprint)
  damaged     one row, but its image file's size or md5 is not the one the row recorded
              (a truncated or empty file)

Images are known from listings only (name, size, md5): verifying never reads their bytes.
"""
from __future__ import annotations

import collections

from pipeline.model import families

VERDICTS = ("ok", "dropped", "missing", "duplicated", "unexpected", "other_run", "foreign", "damaged")
ACCOUNTED = ("ok", "dropped")  # the verdicts of a planned image that is where it should be


def key_of_image(path: str) -> str:
    """An image file's key: its name without folder and extension."""
    return path.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def classify(planned: list, rows: list, images: list | None, fingerprint: str | None = None,
             environment: str | None = None) -> str:
    """The verdict for one key, from what was planned, written and stored under it.

    ``rows``: its metadata rows (``key``, ``dropped``, ``settings_fingerprint``,
    ``image_bytes``, ``image_md5``); ``images``: its image files' listings ({"size", "md5"}),
    None when the run writes no image files (its other formats are written whole per slice,
    and checked as such); ``fingerprint``: run.json's settings fingerprint; ``environment``:
    the environment fingerprint every row must carry (None: neither is checked).
    """
    if not planned:
        return "unexpected"
    if len(planned) > 1 or len(rows) > 1:
        return "duplicated"
    if rows and fingerprint is not None and rows[0].get("settings_fingerprint") != fingerprint:
        return "other_run"
    if rows and environment is not None and rows[0].get("environment") != environment:
        return "foreign"
    if rows and rows[0].get("dropped"):
        return "unexpected" if images else "dropped"
    if not rows or (images is not None and not images):
        return "missing"
    if images is not None and len(images) == 1:
        listed, row = images[0], rows[0]
        if listed["size"] != row.get("image_bytes") or (
                listed.get("md5") and row.get("image_md5") and listed["md5"] != row["image_md5"]):
            return "damaged"
    return "ok" if images is None or len(images) == 1 else "duplicated"


def verify_slice(planned_keys: list[str], rows: list[dict], images: dict[str, dict] | None,
                 fingerprint: str | None = None, environment: str | None = None) -> dict[str, list[str]]:
    """Keys by verdict for one slice (pure): planned keys, its metadata rows, its image
    files' listings ({path: {"size", "md5"}}; None: the run writes no image files),
    run.json's settings fingerprint and the run's environment fingerprint."""
    by_key: dict[str, dict] = collections.defaultdict(lambda: {"planned": [], "rows": [], "images": []})
    for key in planned_keys:
        by_key[key]["planned"].append(key)
    for row in rows:
        by_key[row["key"]]["rows"].append(row)
    for path, listed in (images or {}).items():
        by_key[key_of_image(path)]["images"].append(listed)
    verdicts: dict[str, list[str]] = {v: [] for v in VERDICTS}
    for key in sorted(by_key):
        got = by_key[key]
        verdicts[classify(got["planned"], got["rows"], None if images is None else got["images"],
                          fingerprint, environment)].append(key)
    return verdicts


def unused_negatives(rows: list[dict], guidance_rule: str) -> tuple[int, int]:
    """(records, images) among metadata ``rows`` whose negative prompt played no part at the
    image's guidance under the run's rule (``Rule.negative_unused``)."""
    rule = families.guidance_rule(guidance_rule)
    unused = [row for row in rows if row["negative_prompt"] and rule.negative_unused(row["guidance_scale"])]
    return sum(1 for row in unused if row["image_index"] == 0), len(unused)


def unused_guidance(rows: list[dict], guidance_rule: str) -> tuple[int, int]:
    """(records, images) among metadata ``rows`` given a guidance the model cannot use
    (``Rule.guidance_unused``: a model that takes none, any guidance but 0)."""
    rule = families.guidance_rule(guidance_rule)
    unused = [row for row in rows if rule.guidance_unused(row["guidance_scale"])]
    return sum(1 for row in unused if row["image_index"] == 0), len(unused)
