"""Verification of one slice, without Beam: every key's verdict from what the plan put in
the slice and what the slice's commit wrote (``VerifySlices`` in
``pipeline.collect.transforms`` runs it per slice).

  ok          planned once, one metadata row, its image file (when the run writes files)
              and its thumbnail (when the slice's commit says it wrote thumbnails)
  dropped     planned once, one metadata row whose ``dropped`` reason says a filter kept
              the image out, and no image file and no thumbnail (it is accounted for)
  missing     planned, but no row, no image file or no thumbnail
  duplicated  planned more than once, or more than one row
  unexpected  a row, image file or thumbnail that was never planned in this slice, or an
              image file or thumbnail of an image a filter dropped
  foreign     planned once, one row, but made in another environment than the run's
              (its ``environment`` is not OUT/environment.json's fingerprint)

Images and thumbnails are known from listings only: verifying never reads their bytes.
"""
from __future__ import annotations

import collections

VERDICTS = ("ok", "dropped", "missing", "duplicated", "unexpected", "foreign")
ACCOUNTED = ("ok", "dropped")  # the verdicts of a planned image that is where it should be


def key_of_image(path: str) -> str:
    """An image file's key: its name without folder and extension."""
    return path.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def classify(planned: list, rows: list, images: list | None, thumbs: list | None = None,
             environment: str | None = None) -> str:
    """The verdict for one key, from what was planned, written and stored under it.

    ``images`` is None when the run writes no image files (its other formats are
    written whole per slice, before the slice's commit marker); ``thumbs`` is None when
    the slice's thumbnails are not checked (a slice committed before hosts wrote them);
    ``environment``: the fingerprint every row must carry (None: not checked).
    """
    if not planned:
        return "unexpected"
    if len(planned) > 1 or len(rows) > 1:
        return "duplicated"
    if rows and environment is not None and rows[0].get("environment") != environment:
        return "foreign"
    if rows and rows[0].get("dropped"):
        return "unexpected" if images or thumbs else "dropped"
    if not rows or (images is not None and not images) or (thumbs is not None and not thumbs):
        return "missing"
    return "ok"


def verify_slice(planned_keys: list[str], rows: list[dict], image_paths: list[str] | None,
                 thumb_paths: list[str] | None = None, environment: str | None = None) -> dict[str, list[str]]:
    """Keys by verdict for one slice (pure): planned keys, its metadata rows, its image
    files and its thumbnails (None: not checked), and the environment fingerprint its
    rows must carry (None: not checked)."""
    by_key: dict[str, dict] = collections.defaultdict(lambda: {"planned": [], "rows": [], "images": [],
                                                               "thumbs": []})
    for key in planned_keys:
        by_key[key]["planned"].append(key)
    for row in rows:
        by_key[row["key"]]["rows"].append(row)
    for path in image_paths or ():
        by_key[key_of_image(path)]["images"].append(path)
    for path in thumb_paths or ():
        by_key[key_of_image(path)]["thumbs"].append(path)
    verdicts: dict[str, list[str]] = {v: [] for v in VERDICTS}
    for key in sorted(by_key):
        got = by_key[key]
        verdicts[classify(got["planned"], got["rows"], None if image_paths is None else got["images"],
                          None if thumb_paths is None else got["thumbs"], environment)].append(key)
    return verdicts


def unused_negatives(rows: list[dict], guidance_rule: str) -> tuple[int, int]:
    """(records, images) among metadata ``rows`` whose negative prompt played no part:
    under diffusers' rule an image with guidance <= 1 is not guided, so its negative
    prompt does nothing; a family without classifier-free guidance (the "embedded" and
    "unused" rules: FLUX.1) never uses one (pure)."""
    if guidance_rule in ("embedded", "unused"):
        unused = [row for row in rows if row["negative_prompt"]]
    elif guidance_rule == "diffusers":
        unused = [row for row in rows if row["negative_prompt"] and row["guidance_scale"] <= 1]
    elif guidance_rule == "zimage":  # Z-Image guides above 0
        unused = [row for row in rows if row["negative_prompt"] and row["guidance_scale"] <= 0]
    else:
        return 0, 0
    return sum(1 for row in unused if row["image_index"] == 0), len(unused)


def unused_guidance(rows: list[dict], guidance_rule: str) -> tuple[int, int]:
    """(records, images) among metadata ``rows`` given a guidance the model cannot use:
    under the "unused" rule (FLUX.1 [schnell], which takes none) any guidance but 0 (pure)."""
    if guidance_rule != "unused":
        return 0, 0
    unused = [row for row in rows if row["guidance_scale"] != 0]
    return sum(1 for row in unused if row["image_index"] == 0), len(unused)
