"""The plan bench's synthetic prompts: JSONL shards made deterministically from word lists.

Rows hold 40-200 characters (mean ~112) with a few non-ASCII words; about a third carry
an ``id`` (string or integer), a quarter a ``seed``, and some ``num_images`` 1, a
``negative_prompt``, a ``guidance_scale`` or an extra field. One row in ``DIRTY_EVERY`` is
bad in one of four ways (invalid JSON, empty prompt, ``num_images`` 0, no prompt), so
the rejects path runs too and the expected counts are known exactly. With
``duplicates``, one row in that many repeats the id of the row before it, which the plan
rejects as ``duplicate_id`` (``expected_duplicate_ids`` counts them). Used by ``promptmill
bench plan`` (``pipeline.bench.plan_scale``) and ``bench status``.
"""
from __future__ import annotations

import os
import time

SEED = 20240611
DIRTY_EVERY = 9973  # one bad row in this many (global row index % DIRTY_EVERY == DIRTY_OFFSET)
DIRTY_OFFSET = 17
MIN_CHARS, MAX_CHARS = 40, 200

_ARTICLES = ("a", "an old", "a small", "a lonely", "a giant", "two", "three", "a family of", "a pair of", "the last")
_ADJECTIVES = ("weathered", "glowing", "ancient", "tiny", "rusty", "crystal", "mechanical", "sleepy", "majestic",
               "forgotten", "neon", "wooden", "golden", "moss-covered", "translucent", "paper", "clockwork",
               "feathered", "frozen", "velvet")
_SUBJECTS = ("lighthouse keeper", "red fox", "astronaut", "tea house", "sailing ship", "owl", "robot gardener",
             "cathedral", "koi pond", "street musician", "dragon", "bicycle", "library", "mountain goat", "violin",
             "submarine", "market stall", "samurai", "greenhouse", "windmill", "jellyfish", "train station",
             "cat", "café terrace", "hot air balloon")
_ACTIONS = ("standing in", "drifting over", "hidden inside", "sleeping beside", "reflected in", "floating above",
            "walking through", "overlooking", "painted on the wall of", "half buried in")
_PLACES = ("a foggy harbour", "a bamboo forest", "the ruins of a city", "a desert at noon", "a snowy village",
           "a flooded library", "a street market in Zürich", "a temple garden in Kyōto", "the old town of Kraków",
           "an alien canyon", "a rainy alley", "a field of sunflowers", "the rings of Saturn", "a coral reef",
           "a quiet suburb", "a night train", "the Fjärden archipelago", "a candle-lit cellar")
_MODIFIERS = ("oil painting", "watercolor", "35mm photograph", "isometric render", "ukiyo-e woodblock print",
              "charcoal sketch", "studio lighting", "golden hour", "volumetric fog", "soft focus", "high detail",
              "8k", "wide angle", "macro shot", "by a Renaissance master", "art nouveau poster", "cinematic",
              "pastel colors", "long exposure", "low poly", "tilt-shift", "dramatic shadows", "film grain",
              "trending on an art forum", "muted palette", "vivid colors", "symmetrical composition",
              "bokeh", "backlit", "morning mist", "storybook illustration", "pixel art", "naïve painting",
              "photorealistic", "matte painting", "hand-drawn", "cyanotype", "stained glass", "double exposure")
_NEGATIVES = ("blurry, low quality", "text, watermark", "extra fingers, deformed", "oversaturated")
_GUIDANCE = ("5.0", "7.5", "9.0", "12")
MAX_MODIFIERS = 7

for _word in (*_ARTICLES, *_ADJECTIVES, *_SUBJECTS, *_ACTIONS, *_PLACES, *_MODIFIERS, *_NEGATIVES):
    # the rows are formatted without json.dumps: no character here may need escaping
    assert not set(_word) & set('"\\') and _word.isprintable(), _word

_DIRTY = (  # (reason the plan gives, the line for global row index i)
    ("invalid_json", lambda i: '{"prompt": "a cut-off line %d' % i),
    ("empty_prompt", lambda i: '{"prompt": "   ", "id": "blank-%d"}' % i),
    ("bad_num_images", lambda i: '{"prompt": "a valid prompt asking for no images %d", "num_images": 0}' % i),
    ("missing_prompt", lambda i: '{"text": "the prompt is under the wrong key %d"}' % i),
)


def is_dirty(index: int) -> bool:
    return index % DIRTY_EVERY == DIRTY_OFFSET


def dirty_reason(index: int) -> str:
    return _DIRTY[(index // DIRTY_EVERY) % len(_DIRTY)][0]


def expected_rejects(rows: int) -> dict[str, int]:
    """The rejects, by reason, that the first ``rows`` generated rows hold."""
    counts: dict[str, int] = {}
    for index in range(DIRTY_OFFSET, rows, DIRTY_EVERY):
        reason = dirty_reason(index)
        counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def shard_bounds(rows: int, shards: int, shard: int) -> tuple[int, int]:
    """Global row indices [start, stop) of ``shard``: rows spread evenly over the shards."""
    return rows * shard // shards, rows * (shard + 1) // shards


def shard_name(shard: int, shards: int) -> str:
    return f"prompts-{shard:05d}-of-{shards:05d}.jsonl"


def _prompt(rnd, modifiers: list[str]) -> str:
    head = f"{_ARTICLES[rnd[0]]} {_ADJECTIVES[rnd[1]]} {_SUBJECTS[rnd[2]]} {_ACTIONS[rnd[3]]} {_PLACES[rnd[4]]}"
    text = head
    for k in range(MAX_MODIFIERS):
        if k >= rnd[5] and len(text) >= MIN_CHARS:
            break
        extra = f"{text}, {modifiers[rnd[6 + k]]}"
        if len(extra) > MAX_CHARS:
            break
        text = extra
    return text


# (column of the row's random draws, chance, the field from the row's seed): optional fields, in order
_OPTIONAL_FIELDS = (
    (1, 0.25, lambda seed: f'"seed": {seed}'),
    (2, 0.20, lambda seed: '"num_images": 1'),
    (3, 0.10, lambda seed: f'"negative_prompt": "{_NEGATIVES[seed % len(_NEGATIVES)]}"'),
    (4, 0.05, lambda seed: f'"guidance_scale": {_GUIDANCE[seed % len(_GUIDANCE)]}'),
    (5, 0.05, lambda seed: '"collection": "plan-bench"'),
)


def expected_duplicate_ids(rows: int, every: int) -> int:
    """The ``duplicate_id`` rejects of the first ``rows`` rows, with one in ``every`` repeating an id."""
    if every <= 0:
        return 0
    return sum(1 for index in range(1, rows, every) if not is_dirty(index) and not is_dirty(index - 1))


def shard_lines(rows: int, shards: int, shard: int, seed: int = SEED, duplicates: int = 0) -> list[str]:
    """The JSONL lines (newline included) of one shard; the same for the same arguments.
    ``duplicates``: one row in this many (0: none) repeats the id of the row before it
    (``repeats_an_id``), which carries an explicit id for it."""
    import numpy as np

    start, stop = shard_bounds(rows, shards, shard)
    n = stop - start
    rng = np.random.default_rng([seed, shard])
    columns = [len(_ARTICLES), len(_ADJECTIVES), len(_SUBJECTS), len(_ACTIONS), len(_PLACES), MAX_MODIFIERS + 1]
    columns += [len(_MODIFIERS)] * MAX_MODIFIERS
    picks = np.stack([rng.integers(0, c, n) for c in columns], axis=1).tolist()
    field = rng.random((n, 6)).tolist()  # chance of each optional field
    seeds = rng.integers(0, 2**31, n).tolist()
    lines = []
    for j in range(n):
        index = start + j
        if is_dirty(index):
            lines.append(_DIRTY[(index // DIRTY_EVERY) % len(_DIRTY)][1](index) + "\n")
            continue
        f = field[j]
        parts = [f'{{"prompt": "{_prompt(picks[j], _MODIFIERS)}"']
        if duplicates and index % duplicates in (0, 1):  # a pair: row k*n gives an id, row k*n+1 repeats it
            parts.append(f'"id": "dup-{index - index % duplicates:010d}"')
        elif f[0] < 0.30:
            parts.append(f'"id": "s{shard:05d}-r{index:09d}"')
        elif f[0] < 0.35:
            parts.append(f'"id": {10**12 + index}')
        parts += [field_of(seeds[j]) for column, chance, field_of in _OPTIONAL_FIELDS if f[column] < chance]
        lines.append(", ".join(parts) + "}\n")
    return lines


def generate(folder: str, rows: int, shards: int, seed: int = SEED, duplicates: int = 0) -> dict:
    """Write the shards into ``folder``; returns their paths, bytes and the time taken.
    ``duplicates``: one row in this many repeats an id (``shard_lines``)."""
    if rows < 1 or shards < 1:
        raise ValueError(f"need at least one prompt and one shard, got {rows} prompts in {shards} shards")
    os.makedirs(folder, exist_ok=True)
    start, paths, size = time.perf_counter(), [], 0
    for shard in range(shards):
        data = "".join(shard_lines(rows, shards, shard, seed, duplicates)).encode("utf-8")
        path = os.path.join(folder, shard_name(shard, shards))
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
        size += len(data)
    return {"paths": paths, "bytes": size, "seconds": time.perf_counter() - start}
