"""A static HTML gallery of the dataset (pure functions, streaming).

People want to look at a generated dataset before they load it. The hosts write a
JPEG thumbnail of every image as they encode it, packed per slice
(``OUT/thumbs/SLICE.tar``, in the slice's commit); collect writes, under
``OUT/dataset/``, a paged gallery of a sample of them: ``index.html`` is page 1 and
``gallery/page-NNNNN.html`` the others. Each page holds its thumbnails inline (``data:``
URIs, taken from the packs), so pages are plain HTML5 with inline CSS (no scripts, no
external resources) and open from a local folder, a bucket or a zip alike.

The sample is chosen by position when planning is done, not by what collect finds:
``sample_rank`` picks ``shown`` of the plan's images, evenly spaced (``SAMPLE_SIZE`` by
default, or ``--gallery-max``), so every collect of a run shows the same images.
``--gallery-order`` shows a score's highest instead (a bounded top-k, ``score_key``).

Every name here is relative to the ``dataset/`` folder, and every link is relative
to the page it is on, so OUT can be moved. The metadata's ``path`` column and the
thumbnails are relative to OUT, which is ``..`` from ``dataset/``. A location holding
``#`` (an image inside a tar, parquet or zarr) is no file a browser can open: its
thumbnail links to itself and the location is shown as text.

Each page is rendered on its own (``render_page``); the page list in each page's
navigation shows the first, the last and the nearby pages only, so thousands of pages
stay usable.

A row whose image a score filter dropped is shown without a picture, with the reason;
an image the safety checker flagged has a blurred thumbnail (the host blurred it) and
says so. Each cell shows the row's scores.
"""
from __future__ import annotations

import base64
import html
import math
import posixpath
from urllib.parse import quote

from pipeline.collect.card import visible
from pipeline.output import formats

THUMB_SIZE = formats.THUMB_SIZE
NEARBY_PAGES = 3  # the page list shows pages within this distance of the current one
# --gallery-order: plan order, or a score's (highest first), and the --score each needs
ORDERS = ("position", "clip_similarity", "aesthetic", "nsfw_score")
PAGE_SIZE = 100  # thumbnails per page, unless --gallery-page-size says otherwise
SAMPLE_SIZE = 1000  # images the gallery shows, unless --gallery-max says otherwise
ORDER_SCORES = {"clip_similarity": "clip", "aesthetic": "aesthetic", "nsfw_score": "safety"}


def check_order(order: str, scores) -> None:
    """ValueError unless the gallery can be in ``order`` for a run with ``scores``."""
    if order not in ORDERS:
        raise ValueError(f"--gallery-order must be one of {', '.join(ORDERS)}, got {order!r}")
    if order in ORDER_SCORES and ORDER_SCORES[order] not in scores:
        planned = f"with --score {','.join(scores)}" if scores else "without --score"
        raise ValueError(f"--gallery-order {order}: the run did not compute it (it was planned {planned})")


def score_key(order: str):
    """The sort key of rows by the score ``order``, highest first under ``max``/``nlargest``
    (ties and unscored rows in plan order, unscored last)."""
    def key(row):
        value = row.get(order)
        missing = value is None or (isinstance(value, float) and math.isnan(value))
        return (0 if missing else 1, 0.0 if missing else value, -row["position"])

    return key


def sample_size(total: int, limit: int | None) -> int:
    """How many of ``total`` images a gallery capped at ``limit`` shows (None: ``SAMPLE_SIZE``)."""
    if limit is not None and limit < 1:
        raise ValueError(f"the gallery's cap must be >= 1, got {limit}")
    return min(total, SAMPLE_SIZE if limit is None else limit)


def sample_rank(position: int, images: int, shown: int) -> int | None:
    """The place in the gallery of the image at ``position`` of a plan of ``images``, when
    an even sample of ``shown`` of them picks it (image ``i * images // shown`` for i = 0,
    1, ...: the first always), else None (pure: the plan alone decides it)."""
    shown = min(shown, images)
    if not 0 <= position < images or shown < 1:
        return None
    rank = -(-position * shown // images)  # the least i with i * images // shown >= position
    return rank if rank < shown and rank * images // shown == position else None


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
    if link.startswith("data:"):
        return html.escape(link, quote=True)
    return html.escape(quote(link, safe="/"), quote=True)


def thumb_uri(jpeg: bytes) -> str:
    """A thumbnail inline, as the page's ``data:`` URI (no object of its own to fetch)."""
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")


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
    thumb = thumb_uri(row.get("thumb") or b"")
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


def render_page(rows: list[dict], page: int, total_pages: int, total_images: int, title: str,
                page_size: int = PAGE_SIZE) -> str:
    """Page ``page`` of ``total_pages``, showing ``rows`` (metadata rows: key, prompt, seed,
    slice, path, and ``thumb``, the thumbnail's JPEG bytes), the ``page``-th ``page_size``
    of the gallery's ``total_images``."""
    if not 1 <= page <= total_pages:
        raise ValueError(f"page {page} is not in 1..{total_pages}")
    here = page_name(page)
    if rows:
        first = (page - 1) * page_size + 1
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


def title(model: str, images: int, rows: int, shown: int, order: str) -> str:
    """The gallery's title (pure): the model, the images (and those dropped), how many are
    shown and in which order."""
    found = f"promptmill dataset: {model}, {images} images"
    if rows > images:
        found += f" and {rows - images} dropped by filters"
    if shown < rows:
        found += f", {shown} shown" + (" (an even sample)" if order == "position" else f" (the highest {order})")
    elif order != "position":
        found += f", by {order}"
    return found
