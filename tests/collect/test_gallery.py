"""The gallery: names and links (pure), pages, the plan-time sample, thumbnails, and what Chromium shows."""
from __future__ import annotations

import io
import posixpath
import re
import time

import numpy as np
import pytest
from PIL import Image

from pipeline.collect import gallery
from pipeline.core import naming
from pipeline.output import formats

HREF = re.compile(r'(?:href|src)="([^"]*)"')


THUMB = formats.thumbnail(np.full((8, 8, 3), 90, np.uint8))


def row(i: int, slice_index: int = 0, path: str | None = None, prompt: str | None = None) -> dict:
    key = f"rec{i:06d}_0000"
    return {"key": key, "prompt": prompt if prompt is not None else f"prompt number {i}", "seed": 1000 + i,
            "slice": slice_index, "path": path if path is not None else naming.image_name(slice_index, key),
            "thumb": THUMB}


def pages(rows: list[dict], page_size: int, title: str = "t") -> dict[str, str]:
    """Every page of a gallery of ``rows``, as collect renders them (one page at a time)."""
    total = gallery.page_count(len(rows), page_size)
    return {gallery.page_name(n): gallery.render_page(rows[(n - 1) * page_size:n * page_size], n, total, len(rows),
                                                      title, page_size) for n in range(1, total + 1)}


def resolve(page: str, link: str) -> str:
    """Where ``link`` on ``page`` leads, relative to dataset/."""
    return posixpath.normpath(posixpath.join(posixpath.dirname(page), link))


def png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


# -- names and links ----------------------------------------------------------------

@pytest.mark.parametrize("total, size, expected", [(0, 5, 1), (1, 5, 1), (5, 5, 1), (6, 5, 2), (100_000, 100, 1000),
                                                   (100_001, 100, 1001), (7, 1, 7)])
def test_page_count(total, size, expected):
    assert gallery.page_count(total, size) == expected


def test_page_count_rejects_bad_arguments():
    with pytest.raises(ValueError):
        gallery.page_count(3, 0)
    with pytest.raises(ValueError):
        gallery.page_count(-1, 5)


def test_page_names():
    assert gallery.page_name(1) == "index.html"
    assert gallery.page_name(2) == "gallery/page-00002.html"
    assert gallery.page_name(12345) == "gallery/page-12345.html"
    with pytest.raises(ValueError):
        gallery.page_name(0)


def test_thumbnails_are_inline_data():
    """A page carries its thumbnails (the packs they come from are no files a browser reads)."""
    assert gallery.thumb_uri(b"\xff\xd8jpeg") == "data:image/jpeg;base64,/9hqcGVn"
    page_html = gallery.render_page([row(0)], 1, 1, 1, "t")
    assert f'src="{gallery.thumb_uri(THUMB)}"' in page_html and "thumbs/" not in page_html


@pytest.mark.parametrize("page", ["index.html", "gallery/page-00002.html", "gallery/page-01000.html"])
@pytest.mark.parametrize("target", ["thumbs/00003/k_0000.jpg", "index.html", "gallery/page-00007.html",
                                    "../images/00003/k_0000.png", "metadata.parquet"])
def test_relative_links_resolve(page, target):
    link = gallery.relative(page, target)
    assert not link.startswith("/")
    assert resolve(page, link) == posixpath.normpath(target)


def test_relative_link_spellings():
    assert gallery.relative("index.html", "thumbs/00000/k.jpg") == "thumbs/00000/k.jpg"
    assert gallery.relative("gallery/page-00002.html", "thumbs/00000/k.jpg") == "../thumbs/00000/k.jpg"
    assert gallery.relative("index.html", "../images/00000/k.png") == "../images/00000/k.png"
    assert gallery.relative("gallery/page-00002.html", "../images/00000/k.png") == "../../images/00000/k.png"
    assert gallery.relative("gallery/page-00002.html", "gallery/page-00003.html") == "page-00003.html"
    assert gallery.relative("gallery/page-00002.html", "index.html") == "../index.html"
    with pytest.raises(ValueError):
        gallery.relative("../index.html", "thumbs/x.jpg")


def test_image_target():
    assert gallery.image_target("images/00000/k.png") == "../images/00000/k.png"
    assert gallery.image_target("shards/00000.tar#k.png") is None
    assert gallery.image_target("zarr/images#17") is None


# -- pages --------------------------------------------------------------------------

def test_pages_of_a_large_gallery_link_every_page_and_number_their_images():
    total, size = 100_000, 100
    total_pages = gallery.page_count(total, size)
    for page in (1, 2, 500, 999, 1000):
        name = gallery.page_name(page)
        rows = [row(i, slice_index=i // 4096) for i in range((page - 1) * size, page * size)]
        page_html = gallery.render_page(rows, page, total_pages, total, "big", size)
        assert page_html.count("<img") == size
        assert f"images {(page - 1) * size + 1:,}&ndash;{page * size:,} of {total:,}" in page_html
        for link in HREF.findall(page_html):
            target = resolve(name, link)
            if link.startswith("data:"):
                continue
            if target.endswith(".html"):
                assert target == "index.html" or re.fullmatch(r"gallery/page-\d{5}\.html", target), target
                number = 1 if target == "index.html" else int(target[-10:-5])
                assert 1 <= number <= 1000, target
            else:
                assert re.fullmatch(r"\.\./images/[0-9a-f]{4}-\d{5}/rec\d{6}_0000\.png", target), target


def test_page_navigation_is_compact_and_complete():
    total_pages = 1000
    page_html = gallery.render_page([row(i) for i in range(50)], 500, total_pages, 50_000, "t", 50)
    here = gallery.page_name(500)
    nav = page_html[page_html.index("<nav"):page_html.index("</nav>")]
    linked = sorted({int(resolve(here, link)[-10:-5]) if "page-" in link else 1 for link in HREF.findall(nav)
                     if not link.startswith("data:")})
    assert linked == [1, 497, 498, 499, 501, 502, 503, 1000]
    assert 'aria-current="page">500<' in nav
    assert 'rel="prev"' in nav and 'rel="next"' in nav
    assert "Page 500 of 1000, images 24,951&ndash;25,000 of 50,000" in page_html


def test_last_page_holds_the_rest():
    found = pages([row(i) for i in range(11)], 5)
    assert list(found) == ["index.html", "gallery/page-00002.html", "gallery/page-00003.html"]
    assert "images 1&ndash;5 of 11" in found["index.html"]
    assert "images 11&ndash;11 of 11" in found["gallery/page-00003.html"]
    first = found["index.html"]
    assert '<span class="off">&laquo; first</span>' in first and 'href="gallery/page-00003.html"' in first
    last = found["gallery/page-00003.html"]
    assert 'href="../index.html"' in last and '<span class="off">next &rsaquo;</span>' in last


def test_empty_dataset_has_one_page():
    found = pages([], 100, "empty")
    assert list(found) == ["index.html"]
    assert "no images" in found["index.html"] and "<img" not in found["index.html"]


def test_prompts_and_titles_are_escaped():
    evil = '<script>alert(1)</script> "quoted" & more'
    page_html = gallery.render_page([row(0, prompt=evil)], 1, 1, 1, "<b>title</b>")
    assert "<script" not in page_html and "<b>" not in page_html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page_html
    assert 'title="&lt;script&gt;alert(1)&lt;/script&gt; &quot;quoted&quot; &amp; more"' in page_html


def test_locations_inside_files_get_no_file_link():
    inside = f"shards/{naming.output_name(0)}.tar#rec000000_0000.png"
    page_html = gallery.render_page([row(0, path=inside)], 2, 2, 2, "t", 1)
    links = HREF.findall(page_html)
    assert not any("#" in link or "shards" in link for link in links)
    thumb = gallery.thumb_uri(THUMB)
    assert f'<a href="{thumb}"><img src="{thumb}"' in page_html
    assert f">{inside}</div>" in page_html  # shown as text
    plain = gallery.render_page([row(0)], 2, 2, 2, "t", 1)
    assert f'<a href="../../{naming.image_name(0, "rec000000_0000")}"><img src="{thumb}"' in plain


def test_no_external_resources_or_scripts():
    page_html = gallery.render_page([row(i) for i in range(3)], 1, 1, 3, "t")
    assert "<script" not in page_html and "http://" not in page_html and "https://" not in page_html
    assert page_html.startswith("<!DOCTYPE html>")


# -- the plan-time sample ----------------------------------------------------------

@pytest.mark.parametrize("total,shown", [(10, 3), (10, 10), (3, 10), (1000, 7), (7, 1), (0, 5), (101, 100),
                                         (1_000_003, 1000)])
def test_the_sample_is_evenly_spaced_positions_each_with_its_place(total, shown):
    """The plan alone picks the gallery's images: position ``i * total // shown`` is the
    i-th shown, whatever collect finds (so every collect of a run shows the same ones)."""
    picked = {p: gallery.sample_rank(p, total, shown) for p in range(total)}
    kept = sorted(p for p, rank in picked.items() if rank is not None)
    assert len(kept) == min(total, shown) and (not kept or kept[0] == 0)
    assert [picked[p] for p in kept] == list(range(len(kept)))  # its place in the gallery, in order
    if kept:  # gaps differ by at most one: evenly spread over the whole run
        gaps = [b - a for a, b in zip(kept, [*kept[1:], total])]
        assert max(gaps) - min(gaps) <= 1, gaps
    assert gallery.sample_rank(total, total, shown) is None and gallery.sample_rank(-1, total, shown) is None


def test_the_default_sample_is_fixed_and_a_cap_below_one_is_refused():
    assert gallery.sample_size(10_000_000, None) == gallery.SAMPLE_SIZE == 1000
    assert gallery.sample_size(5, None) == 5 and gallery.sample_size(10_000_000, 20_000) == 20_000
    with pytest.raises(ValueError, match=">= 1"):
        gallery.sample_size(0, 0)


# -- thumbnails ---------------------------------------------------------------------

def test_thumbnail_is_deterministic_and_fits():
    rng = np.random.default_rng(1)
    source = png(rng.integers(0, 256, (256, 512, 3), dtype=np.uint8))
    first = formats.thumbnail(source)
    assert first == formats.thumbnail(source)
    with Image.open(io.BytesIO(first)) as image:
        assert image.format == "JPEG" and image.mode == "RGB" and image.size == (128, 64)
        assert "exif" not in image.info
    assert formats.thumbnail(source, size=32) != first


@pytest.mark.parametrize("fmt, mode", [("JPEG", "RGB"), ("WEBP", "RGB"), ("PNG", "RGBA"), ("PNG", "L")])
def test_thumbnail_reads_other_formats(fmt, mode):
    image = Image.new(mode, (300, 200), 90)
    data = io.BytesIO()
    image.save(data, format=fmt)
    with Image.open(io.BytesIO(formats.thumbnail(data.getvalue()))) as thumb:
        assert thumb.size == (128, 85) and thumb.mode == "RGB"


def test_a_thumbnail_of_pixels_is_the_thumbnail_of_their_png():
    """Hosts make thumbnails from pixels, collect from an old run's PNGs: the same bytes."""
    pixels = np.random.default_rng(3).integers(0, 256, (96, 64, 3), dtype=np.uint8)
    assert formats.thumbnail(pixels) == formats.thumbnail(formats.encode(pixels, "png"))
    assert formats.thumbnail(pixels) != formats.thumbnail(pixels[::-1].copy())


def test_thumbnail_does_not_enlarge():
    with Image.open(io.BytesIO(formats.thumbnail(png(np.zeros((40, 60, 3), np.uint8))))) as thumb:
        assert thumb.size == (60, 40)


# -- what a browser shows -----------------------------------------------------------

def write_gallery(out, count: int, page_size: int, without_thumb: int | None = None) -> list[dict]:
    """OUT/images/SLICE/KEY.png and the pages, their thumbnails inline (but row
    ``without_thumb``'s); returns the rows."""
    rng = np.random.default_rng(7)
    rows = []
    for i in range(count):
        blocks = rng.integers(0, 200, (16, 16, 3), dtype=np.uint8)  # colourful, never near white
        data = png(np.kron(blocks, np.ones((16, 16, 1), np.uint8)))  # 256 x 256
        r = row(i)
        image = out / r["path"]
        image.parent.mkdir(parents=True, exist_ok=True)
        image.write_bytes(data)
        r["thumb"] = formats.thumbnail(data) if i != without_thumb else b""
        rows.append(r)
    for name, page_html in pages(rows, page_size, "chromium test").items():
        page = out / "dataset" / name
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(page_html, encoding="utf-8")
    return rows


def test_chromium_shows_the_thumbnails(tmp_path):
    """Needs Debian's chromium (installed when root; skipped without root unless CI=true)."""
    from tests import chromium

    chromium.ensure()
    started = time.monotonic()
    out = tmp_path / "out"
    write_gallery(out, 11, 5)
    dataset = out / "dataset"
    assert sorted(p.relative_to(dataset).as_posix() for p in dataset.rglob("*.html")) == [
        "gallery/page-00002.html", "gallery/page-00003.html", "index.html"]

    shots = tmp_path / "shots"
    shots.mkdir()
    chromium.screenshot(dataset / "index.html", shots / "1.png", 1000, 1400)
    assert chromium.count_thumbnails(shots / "1.png") == 5
    chromium.screenshot(dataset / "gallery/page-00003.html", shots / "3.png", 1000, 1400)
    assert chromium.count_thumbnails(shots / "3.png") == 1

    # every link of page 1 reaches a file that exists, or is the thumbnail inline
    for link in HREF.findall((dataset / "index.html").read_text()):
        assert link.startswith("data:image/jpeg;base64,") or (dataset / link).resolve().is_file(), link

    # the count sees a missing thumbnail
    write_gallery(out, 11, 5, without_thumb=2)
    chromium.screenshot(dataset / "index.html", shots / "1-missing.png", 1000, 1400)
    assert chromium.count_thumbnails(shots / "1-missing.png") == 4
    print(f"chromium test: {time.monotonic() - started:.1f}s")


def test_a_long_key_shows_whole_on_hover():
    long_key = "a-very-long-folder-name-p-jsonl-3--c4945e81959d1234_0000"
    page_html = gallery.render_page([{**row(0), "key": long_key}], 1, 1, 1, "t")
    assert f'<div class="key" title="{long_key}">{long_key}</div>' in page_html
