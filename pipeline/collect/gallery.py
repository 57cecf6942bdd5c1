"""A static HTML gallery of the dataset (pure functions, streaming).

People want to look at a generated dataset before they load it. The hosts write a
JPEG thumbnail of every image as they encode it (``OUT/thumbs/NNNNN/KEY.jpg``, in the
slice's commit); collect writes, under ``OUT/dataset/``, a paged gallery of them:
``index.html`` is page 1 and ``gallery/page-NNNNN.html`` the others. Pages are plain
HTML5 with inline CSS (no scripts, no external resources), so they open from a local
folder, a bucket or a zip alike.

Every name here is relative to the ``dataset/`` folder, and every link is relative
to the page it is on, so OUT can be moved. The metadata's ``path`` column and the
thumbnails are relative to OUT, which is ``..`` from ``dataset/``. A location holding
``#`` (an image inside a tar, parquet or zarr) is no file a browser can open: its
thumbnail links to itself and the location is shown as text.

``pages`` holds one page of rows at a time, so a gallery of millions of images is
written in constant memory; the page list in each page's navigation shows the first,
the last and the nearby pages only, so thousands of pages stay usable. ``even_sample``
caps how many images a huge dataset's gallery shows. ``ranked`` orders it by a score
instead, highest first (holding the rows it shows).

A row whose image a score filter dropped is shown without a picture, with the reason;
an image the safety checker flagged has a blurred thumbnail (the host blurred it) and
says so. Each cell shows the row's scores.
"""
from __future__ import annotations

import heapq
import html
import math
import posixpath
from typing import Iterable, Iterator
from urllib.parse import quote

from pipeline.collect.card import visible
from pipeline.core import naming
from pipeline.output import formats

THUMB_SIZE = formats.THUMB_SIZE
NEARBY_PAGES = 3  # the page list shows pages within this distance of the current one
# --gallery-order: plan order, or a score's (highest first), and the --score each needs
ORDERS = ("position", "clip_similarity", "aesthetic", "nsfw_score")
PAGE_SIZE = 100  # thumbnails per page, unless --gallery-page-size says otherwise
ORDER_SCORES = {"clip_similarity": "clip", "aesthetic": "aesthetic", "nsfw_score": "safety"}


def check_order(order: str, scores) -> None:
    """ValueError unless the gallery can be in ``order`` for a run with ``scores``."""
    if order not in ORDERS:
        raise ValueError(f"--gallery-order must be one of {', '.join(ORDERS)}, got {order!r}")
    if order in ORDER_SCORES and ORDER_SCORES[order] not in scores:
        planned = f"with --score {','.join(scores)}" if scores else "without --score"
        raise ValueError(f"--gallery-order {order}: the run did not compute it (it was planned {planned})")


def ranked(rows: Iterable[dict], order: str, limit: int | None) -> list[dict]:
    """The rows by the score ``order``, highest first (ties and unscored rows in plan
    order, unscored last): all of them, or the ``limit`` highest. Every row of ``rows``
    is consumed; only the kept ones are held."""
    def key(row):
        value = row.get(order)
        missing = value is None or (isinstance(value, float) and math.isnan(value))
        return (0 if missing else 1, 0.0 if missing else value, -row["position"])

    if limit is None:
        return sorted(rows, key=key, reverse=True)
    sample_size(0, limit)
    return heapq.nlargest(limit, rows, key=key)


def thumb_path(slice_index: int, key: str) -> str:
    """Where the thumbnail of ``key`` is, relative to ``dataset/``: the host wrote it
    beside the slice's images, under OUT (``naming.thumb_name``)."""
    return "../" + naming.thumb_name(slice_index, key)


def sample_size(total: int, limit: int | None) -> int:
    """How many of ``total`` images a gallery capped at ``limit`` shows (None: no cap)."""
    if limit is not None and limit < 1:
        raise ValueError(f"the gallery's cap must be >= 1, got {limit}")
    return total if limit is None else min(total, limit)


def even_sample(rows: Iterable[dict], total: int, limit: int | None) -> Iterator[dict]:
    """The rows an even sample of ``sample_size(total, limit)`` of ``total`` rows keeps, in
    their order: row ``i * total // shown`` for i = 0, 1, ... (the first row always).

    Every row of ``rows`` is consumed, kept or not, so a generator that writes as it
    yields (collect's metadata.parquet) is written whole.
    """
    shown = sample_size(total, limit)
    next_pick = 0  # the index of the next sample
    for index, row in enumerate(rows):
        if next_pick < shown and index == next_pick * total // shown:
            next_pick += 1
            yield row


def page_count(total: int, page_size: int) -> int:
    """How many pages ``total`` images fill; at least one (an empty dataset has a page saying so)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    return max(1, -(-total // page_size))


def page_name(page: int) -> str:
    """The file of page ``page`` (1-based), relative to ``dataset/``."""
    if page < 1:
        raise ValueError(f"pages are numbered from 1, got {page}")
    return "index.html" if page == 1 else f"gallery/page-{page:05d}.html"


def relative(from_page: str, target: str) -> str:
    """The link from the file ``from_page`` to ``target``, both relative to ``dataset/``.

    ``target`` may leave ``dataset/`` with leading ``..`` (``../images/...`` is an image
    file under OUT); ``from_page`` may not.
    """
    source = posixpath.normpath(from_page)
    if source.startswith(("/", "..")) or posixpath.isabs(target):
        raise ValueError(f"relative() takes paths relative to dataset/, got {from_page!r} -> {target!r}")
    folder = [part for part in posixpath.dirname(source).split("/") if part]
    parts = posixpath.normpath(target).split("/")
    common = 0
    while common < min(len(folder), len(parts) - 1) and folder[common] == parts[common]:
        common += 1
    return "/".join([".."] * (len(folder) - common) + parts[common:])


def image_target(path: str) -> str | None:
    """The dataset-relative target of a metadata ``path`` (relative to OUT); None if no file holds it."""
    if "#" in path:
        return None
    return "../" + path


def _href(link: str) -> str:
    return html.escape(quote(link, safe="/"), quote=True)


def _page_window(page: int, total_pages: int) -> list[int | None]:
    """Page numbers to list, with None where pages are skipped."""
    shown = sorted({1, total_pages, *range(max(1, page - NEARBY_PAGES), min(total_pages, page + NEARBY_PAGES) + 1)})
    window: list[int | None] = []
    for number in shown:
        if window and number - window[-1] > 1:
            window.append(None)
        window.append(number)
    return window


def _nav(page: int, total_pages: int) -> str:
    here = page_name(page)

    def link(number: int, label: str, rel: str = "") -> str:
        if number == page or not 1 <= number <= total_pages:
            return f'<span class="off">{label}</span>'
        rel_attr = f' rel="{rel}"' if rel else ""
        return f'<a href="{_href(relative(here, page_name(number)))}"{rel_attr}>{label}</a>'

    items = [link(1, "&laquo; first"), link(page - 1, "&lsaquo; prev", "prev")]
    for number in _page_window(page, total_pages):
        if number is None:
            items.append('<span class="gap">&hellip;</span>')
        elif number == page:
            items.append(f'<span class="here" aria-current="page">{number}</span>')
        else:
            items.append(link(number, str(number)))
    items += [link(page + 1, "next &rsaquo;", "next"), link(total_pages, "last &raquo;")]
    return '<nav class="pages">' + " ".join(items) + "</nav>"


def _scores(row: dict) -> str:
    """The row's scores as a caption line (none: empty)."""
    parts = []
    for name, label in (("clip_similarity", "clip"), ("aesthetic", "aesthetic"), ("nsfw_score", "nsfw")):
        value = row.get(name)
        if value is not None:
            parts.append(f"{label} {value:.3f}")
    return f'<div class="scores">{html.escape(" · ".join(parts))}</div>' if parts else ""


def _text(value) -> str:
    """User data (a prompt, a key, a reason) as HTML text or attribute: escaped, its
    control characters made visible (``card.visible``: a NUL never reaches the page)."""
    return html.escape(visible(str(value)), quote=True)


def thumb_box(width, height) -> tuple[int, int]:
    """The thumbnail's box on the page (pure): the image's own aspect ratio, its longer side
    ``THUMB_SIZE`` (a thumbnail of a smaller image is shown enlarged); a square without sizes."""
    if not width or not height:
        return THUMB_SIZE, THUMB_SIZE
    scale = THUMB_SIZE / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _size(row: dict) -> str:
    return f" · {int(row['width'])}x{int(row['height'])}" if row.get("width") and row.get("height") else ""


def _cell(row: dict, here: str) -> str:
    key = str(row["key"])
    prompt = str(row.get("prompt") or "")
    caption = (f'<figcaption><div class="prompt" title="{_text(prompt)}">{_text(prompt)}</div>'
               f'<div class="meta">seed {_text(str(row.get("seed")))}{_size(row)}</div>{_scores(row)}'
               f'<div class="key" title="{_text(key)}">{_text(key)}</div>')
    dropped = row.get("dropped")
    if dropped:  # no output holds it, and no thumbnail was made: the row alone, and why
        return (f'<figure class="dropped"><div class="nopic" title="{_text(dropped)}">dropped: '
                f'{_text(dropped)}</div>{caption}</figcaption></figure>')
    thumb = relative(here, thumb_path(int(row["slice"]), key))
    path = str(row["path"])
    target = image_target(path)
    href = thumb if target is None else relative(here, target)
    location = "" if target is not None else f'<div class="loc" title="{_text(path)}">{_text(path)}</div>'
    flagged = '<div class="flag">flagged by the safety checker (thumbnail blurred)</div>' if row.get("nsfw") else ""
    width, height = thumb_box(row.get("width"), row.get("height"))
    return (
        f'<figure><a href="{_href(href)}"><img src="{_href(thumb)}" width="{width}" height="{height}" '
        f'loading="lazy" alt="{_text(key)}"></a>{caption}{flagged}{location}</figcaption></figure>'
    )


_STYLE = f"""
html,body{{background:#fff;color:#222;margin:0}}
body{{font:14px/1.4 system-ui,sans-serif;padding:16px}}
h1{{font-size:20px;margin:0 0 8px}}
.summary{{margin:0 0 8px;color:#555}}
nav.pages{{margin:8px 0;display:flex;flex-wrap:wrap;gap:6px}}
nav.pages a,nav.pages span{{padding:2px 6px}}
nav.pages .here{{font-weight:bold}}
nav.pages .off{{color:#aaa}}
.grid{{display:grid;grid-template-columns:repeat(auto-fill,{THUMB_SIZE + 40}px);gap:16px;margin:16px 0}}
figure{{margin:0;width:{THUMB_SIZE + 40}px}}
figure a{{display:flex;align-items:center;justify-content:center;width:{THUMB_SIZE}px;height:{THUMB_SIZE}px;
  margin:8px auto 0;text-decoration:none}}
figure img{{display:block;max-width:{THUMB_SIZE}px;max-height:{THUMB_SIZE}px;object-fit:contain;border:0;
  background:none;margin:0;padding:0}}
figcaption{{margin-top:12px;font-size:12px;overflow:hidden}}
figcaption .prompt{{display:-webkit-box;-webkit-line-clamp:3;-webkit-box-orient:vertical;overflow:hidden;
  overflow-wrap:anywhere}}
figcaption .meta,figcaption .key,figcaption .loc,figcaption .scores{{color:#666;white-space:nowrap;
  overflow:hidden;text-overflow:ellipsis}}
figcaption .flag{{color:#a40}}
.nopic{{width:{THUMB_SIZE}px;height:{THUMB_SIZE}px;margin:8px auto 0;box-sizing:border-box;padding:8px;
  border:1px dashed #bbb;color:#777;font-size:11px;overflow:hidden;overflow-wrap:anywhere}}
.empty{{margin:32px 0;color:#555}}
"""


def render_page(rows: list[dict], page: int, total_pages: int, total_images: int, title: str) -> str:
    """Page ``page`` of ``total_pages``, showing ``rows`` (metadata rows: key, prompt, seed, slice, path).

    Every page but the last is full, so the rows' place in the dataset follows from
    their count: the last page ends at ``total_images``.
    """
    if not 1 <= page <= total_pages:
        raise ValueError(f"page {page} is not in 1..{total_pages}")
    here = page_name(page)
    if rows:
        first = (page - 1) * len(rows) + 1 if page < total_pages else total_images - len(rows) + 1
        summary = (f"Page {page} of {total_pages}, images {first:,}&ndash;{first + len(rows) - 1:,} "
                   f"of {total_images:,}")
        body = '<main class="grid">' + "".join(_cell(row, here) for row in rows) + "</main>"
    else:
        summary = f"Page {page} of {total_pages}, no images"
        body = '<p class="empty">This dataset has no images.</p>'
    nav = _nav(page, total_pages)
    safe_title = _text(title)
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{safe_title} &middot; page {page}</title><style>{_STYLE}</style></head>\n"
        f"<body><h1>{safe_title}</h1><p class=\"summary\">{summary}</p>\n{nav}\n{body}\n{nav}\n</body></html>\n"
    )


def pages(rows: Iterable[dict], total_images: int, page_size: int, title: str) -> Iterator[tuple[str, str]]:
    """Yield ``(page_name, html)`` for every page, consuming ``rows`` one page at a time.

    ``rows`` must hold exactly ``total_images`` rows, in the gallery's order; ValueError
    otherwise (as soon as it shows: a short input after the pages before it were yielded).
    No rows: one page saying so.
    """
    total_pages = page_count(total_images, page_size)
    page, buffer, seen = 1, [], 0
    for row in rows:
        seen += 1
        if seen > total_images:
            raise ValueError(f"more rows than total_images={total_images}")
        buffer.append(row)
        if len(buffer) == page_size:
            yield page_name(page), render_page(buffer, page, total_pages, total_images, title)
            page, buffer = page + 1, []
    if seen != total_images:
        raise ValueError(f"got {seen} rows, expected total_images={total_images}")
    if buffer or total_images == 0:
        yield page_name(page), render_page(buffer, page, total_pages, total_images, title)
