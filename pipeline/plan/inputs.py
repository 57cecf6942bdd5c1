"""Prompt file formats: which reader a file gets, and the readers.

The format of a file is chosen by its extension, after an optional ``.gz`` (which is
decompressed while reading):

==========  ==================================================================  =========
extension   content                                                             "line"
==========  ==================================================================  =========
.jsonl      one JSON object per line (blank lines are not rows)                 line
.txt        one prompt per line (blank lines are not rows)                      line
.csv .tsv   a header row, then one row per record (the ``csv`` module: quoted   line the
            fields may hold delimiters, quotes and newlines)                    row starts on
.json       one JSON array of objects, or of strings (prompts); read whole      element (1-based)
.parquet    one row per record; read one batch at a time                        row (1-based)
==========  ==================================================================  =========

For CSV and TSV the header is line 1, so the first data row is line 2 (later if a
quoted field spans lines). A line or row number of 0 in a reject means the whole file
(a ``.json`` file that is not valid JSON, a Parquet file that cannot be read, a CSV
header with a repeated name or without the prompt column).

``read_rows(path)`` yields ``(path, number, payload)``; the payload is

* ``bytes``: one raw line of a ``.jsonl`` or ``.txt`` file, decoded during validation
  (``records.parse_jsonl_line`` / ``records.parse_text_line``), as before;
* ``dict``: a row a reader decoded; empty CSV cells and Parquet nulls are left out
  (absent), except the prompt's own cell; a string element of a JSON array is
  ``{prompt_field: element}``;
* ``records.Reject``: a row or file the reader could not decode.

Everything streams except ``.json``: a JSON array file is loaded whole, so keep such
files to a reasonable size (use JSONL, CSV or Parquet shards for big inputs).
"""
from __future__ import annotations

import base64
import collections
import contextlib
import csv
import datetime as dt
import decimal
import json
import math
import shutil
import tempfile
from typing import Iterator

from apache_beam.io.filesystem import CompressionTypes

from pipeline.core.records import Reject
from pipeline.io import beamio

FORMATS = {".jsonl": "jsonl", ".txt": "txt", ".csv": "csv", ".tsv": "tsv", ".json": "json", ".parquet": "parquet"}
LINE_FORMATS = ("jsonl", "txt")  # payloads are raw line bytes
SUPPORTED = ", ".join(f"{ext}[.gz]" for ext in FORMATS)
PARQUET_BATCH_ROWS = 1024
_RAW_CHARS = 1000  # of a whole-file reject's raw text


class UnsupportedInput(ValueError):
    pass


class TruncatedFile(ValueError):
    """A compressed prompt file that ends early: the plan fails rather than planning the
    rows before the cut as if they were the whole file."""


def format_of(path: str) -> str:
    """The format of ``path`` by its extension (``.gz`` stripped first); ValueError if unknown."""
    name = path.rsplit("/", 1)[-1].lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for ext, fmt in FORMATS.items():
        if name.endswith(ext):
            return fmt
    raise UnsupportedInput(f"{path}: unknown prompt file format; supported extensions: {SUPPORTED}")


def check_formats(paths) -> None:
    """Raise ``UnsupportedInput`` naming every file of an unknown format (at most 10)."""
    bad = []
    for path in paths:
        try:
            format_of(path)
        except UnsupportedInput:
            bad.append(path)
    if bad:
        shown = ", ".join(bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise UnsupportedInput(f"unknown prompt file format: {shown}; supported extensions: {SUPPORTED}")


def read_rows(path: str, prompt_field: str = "prompt") -> Iterator[tuple[str, int, object]]:
    """The rows of one prompt file: ``(path, number, payload)`` (see the module doc).

    A compressed file that ends early raises ``TruncatedFile``, naming the file and the
    rows read before the cut: a shorter file must never pass for the whole one."""
    rows = 0
    try:
        for row in _rows(path, prompt_field):
            rows += 1
            yield row
    except beamio.TruncatedInput as e:
        raise TruncatedFile(f"{e}: {rows} row(s) read before the cut; nothing is planned from a partial file. "
                            f"Replace {path} with the whole file and plan again") from None


def _rows(path: str, prompt_field: str):
    fmt = format_of(path)
    if fmt in LINE_FORMATS:
        for number, raw in enumerate(beamio.iter_lines(path), start=1):
            yield path, number, raw
    elif fmt in ("csv", "tsv"):
        yield from _read_delimited(path, "," if fmt == "csv" else "\t", prompt_field)
    elif fmt == "json":
        yield from _read_json_array(path, prompt_field)
    else:
        yield from _read_parquet(path, prompt_field)


def _read_delimited(path: str, delimiter: str, prompt_field: str):
    """The rows of a CSV or TSV file, each parsed on its own (``csv``'s strict dialect).

    A quoted field may span lines, so a stray quote could swallow the rest of the file
    into one field. A record is therefore never taken on trust when it spans lines and
    is bad: a quote still open at the end of the file, a character after a closing
    quote, or a field count other than the header's rejects the row where it starts,
    and its later lines are read again as rows of their own (each planned or rejected
    with its reason), so no row is merged into another or lost."""
    bad_lines: set[int] = set()

    def text_lines(stream):
        for number, raw in enumerate(beamio.split_lines(stream, keep_ends=True), start=1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError:
                bad_lines.add(number)
                yield number, raw.decode("utf-8", "replace")

    with beamio.open_read(path, CompressionTypes.AUTO) as stream:
        header = None
        for start, lines, cells, error in _delimited_records(text_lines(stream), delimiter,
                                                             lambda: header and len(header)):
            raw = "".join(lines).rstrip("\r\n") if error else delimiter.join(cells)
            if not error and not cells:  # a blank line is not a row
                continue
            if any(number in bad_lines for number in range(start, start + len(lines))):
                if header is None:  # without a header no row can be read
                    yield path, 0, Reject(path, 0, "invalid_utf8", "the header row is not valid UTF-8", raw)
                    return
                yield path, start, Reject(path, start, "invalid_utf8", "the row is not valid UTF-8", raw)
                continue
            if error:
                if header is None:
                    yield path, 0, Reject(path, 0, "bad_header", f"the header row is bad: {error}", raw)
                    return
                yield path, start, Reject(path, start, "bad_row", error, raw)
                continue
            if header is None:
                header = [name.strip() for name in cells]
                repeated = sorted({name for name in header if header.count(name) > 1})
                if repeated:
                    yield path, 0, Reject(path, 0, "bad_header",
                                          f"the header repeats column names: {', '.join(map(repr, repeated))}", raw)
                    return
                if prompt_field not in header:  # no row could have a prompt: one reject for the file
                    yield path, 0, Reject(path, 0, "bad_header",
                                          f"the header has no {prompt_field!r} column (--prompt-field); its columns: "
                                          f"{', '.join(map(repr, header))[:_RAW_CHARS]}", raw)
                    return
                continue
            if len(cells) != len(header):
                yield path, start, Reject(path, start, "bad_row",
                                          f"the row has {len(cells)} fields, the header has {len(header)}", raw)
                continue
            yield path, start, {name: value for name, value in zip(header, cells)
                                if value != "" or name == prompt_field}


_CSV_ERRORS = {  # the csv module's words for a stray quote, in ours
    "unexpected end of data": "a quoted field is still open at the end of the file (a stray quote?)",
    "',' expected after '\"'": "text follows a closing quote (a stray quote?)",
    "'\\t' expected after '\"'": "text follows a closing quote (a stray quote?)",
}


def _delimited_records(numbered_lines, delimiter: str, width):
    """``(first line number, its lines, cells, error)`` of each record of a delimited text
    (``numbered_lines``: (number, text with its line ending); ``width()``: the header's
    field count, None before it). A record that spans lines and cannot be parsed or has
    another field count (``error``: why) gives back its later lines, which are parsed
    again as records of their own."""
    source = iter(numbered_lines)
    pushed: collections.deque = collections.deque()
    while True:
        taken: list[tuple[int, str]] = []

        def feed():
            while True:
                item = pushed.popleft() if pushed else next(source, None)
                if item is None:
                    return
                taken.append(item)
                yield item[1]

        reader = csv.reader(feed(), delimiter=delimiter, strict=True)
        try:
            cells, error = next(reader), None
        except StopIteration:
            return
        except csv.Error as e:  # strict: a quote open at the end, or text after a closing quote
            cells, error = [], f"the row cannot be parsed: {_CSV_ERRORS.get(str(e), e)}"
        if not taken:
            return
        if len(taken) > 1 and not error and width() and len(cells) != width():
            error = f"the row has {len(cells)} fields, the header has {width()}"
        if error and len(taken) > 1:
            pushed.extendleft(reversed(taken[1:]))
            taken = taken[:1]
        yield taken[0][0], [text for _, text in taken], cells, error


def _read_json_array(path: str, prompt_field: str):
    with beamio.open_read(path, CompressionTypes.AUTO) as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        yield path, 0, Reject(path, 0, "invalid_utf8", f"the file is not valid UTF-8 ({e.reason} at byte {e.start})",
                              data[:_RAW_CHARS].decode("utf-8", "replace"))
        return
    try:
        elements = json.loads(text)
    except json.JSONDecodeError as e:
        yield path, 0, Reject(path, 0, "invalid_json",
                              f"the file is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                              text[:_RAW_CHARS])
        return
    if not isinstance(elements, list):
        yield path, 0, Reject(path, 0, "not_an_array", f"a .json prompt file must hold one JSON array, "
                              f"got {type(elements).__name__}", text[:_RAW_CHARS])
        return
    for number, element in enumerate(elements, start=1):
        yield path, number, {prompt_field: element} if isinstance(element, str) else element


def _plain(value):
    """A Parquet value as JSON can hold it (pass-through fields end up in JSON metadata)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode("ascii")
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, dt.timedelta)):
        return str(value)
    return value


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _with_plain_times(batch):
    """``batch`` with its nanosecond times as ISO text: pyarrow turns nanoseconds into
    Python values only through pandas, which a plan does not need."""
    import pyarrow as pa

    for index, field in enumerate(batch.schema):
        if getattr(field.type, "unit", None) == "ns":
            batch = batch.set_column(index, field.name, batch.column(index).cast(pa.string()))
    return batch


def _read_parquet(path: str, prompt_field: str = "prompt"):
    """Rows of a Parquet file, one batch of ``PARQUET_BATCH_ROWS`` at a time.

    Whatever pyarrow cannot read (not Parquet, corrupt) is one ``unreadable_file``
    reject; other errors (I/O) propagate so that Beam retries the file. A
    ``.parquet.gz`` is decompressed into a local temporary file first, since Parquet
    needs to seek.
    """
    import pyarrow
    import pyarrow.parquet as pq

    gz = path.lower().endswith(".gz")
    try:
        with beamio.open_read(path, CompressionTypes.AUTO) as f, \
                (tempfile.TemporaryFile() if gz else contextlib.nullcontext(f)) as source:
            if gz:
                shutil.copyfileobj(f, source, beamio.READ_CHUNK)
                source.seek(0)
            number = 0
            for batch in pq.ParquetFile(source, pre_buffer=False).iter_batches(batch_size=PARQUET_BATCH_ROWS,
                                                                               use_threads=False):
                for row in _with_plain_times(batch).to_pylist():
                    number += 1
                    undecodable = [k for k in (prompt_field, "negative_prompt", "id")
                                   if isinstance(row.get(k), bytes) and not _is_utf8(row[k])]
                    if undecodable:
                        yield path, number, Reject(path, number, "invalid_utf8", f"the {undecodable[0]!r} column "
                                                   f"holds bytes that are not UTF-8 text", "")
                        continue
                    # null, and NaN (a missing number as pandas writes it), are an absent field
                    yield path, number, {k: _plain(v) for k, v in row.items()
                                         if v is not None and not (isinstance(v, float) and math.isnan(v))}
    except pyarrow.ArrowException as e:
        yield path, 0, Reject(path, 0, "unreadable_file", f"the Parquet file cannot be read: {e}", "")
