"""Prompt file formats (pipeline.plan.inputs): the same records from every format."""
import csv
import datetime as dt
import gzip
import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.testing.test_pipeline import TestPipeline

from pipeline.core import naming, records
from pipeline.core.settings import Settings, fingerprint
from pipeline.io import storage
from pipeline.plan import inputs, layout, transforms as plan
from pipeline.plan.prepare import prepare

# Six rows exercising every optional field, pass-through fields on some rows, and text that
# needs CSV quoting (delimiters, quotes, a newline inside a field) and non-ASCII.
ROWS = [
    {"id": "r1", "prompt": "a red fox", "seed": 11},
    {"id": "r2", "prompt": 'a blue whale, "quoted"\nsecond line', "num_images": 2, "negative_prompt": "blurry"},
    {"id": "r3", "prompt": "été café 🎨", "guidance_scale": 7.5, "style": "noir"},
    {"id": "r4", "prompt": "four\tfields", "seed": 4, "num_images": 2, "guidance_scale": 3.0, "style": "pop"},
    {"id": "r5", "prompt": "five", "negative_prompt": "text, watermark"},
    {"id": "r6", "prompt": "six", "seed": 6},
]
COLUMNS = ["id", "prompt", "negative_prompt", "seed", "num_images", "guidance_scale", "style"]
# the line (row, element) of each record: CSV and TSV count the header as line 1, and r2 spans two lines
LINES = {"csv": [2, 3, 5, 6, 7, 8], "tsv": [2, 3, 5, 6, 7, 8]}


def encode(fmt: str, rows) -> bytes:
    if fmt == "jsonl":
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    if fmt == "json":
        return json.dumps(rows, indent=1, ensure_ascii=False).encode()
    if fmt in ("csv", "tsv"):
        text = io.StringIO()
        writer = csv.DictWriter(text, COLUMNS, restval="", delimiter="," if fmt == "csv" else "\t")
        writer.writeheader()
        writer.writerows(rows)
        return text.getvalue().encode()
    if fmt == "parquet":
        schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("negative_prompt", pa.string()),
                            ("seed", pa.int64()), ("num_images", pa.int32()), ("guidance_scale", pa.float64()),
                            ("style", pa.string())])
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), buffer, row_group_size=4)  # 2 row groups
        return buffer.getvalue()
    raise ValueError(fmt)


def write(path, data: bytes) -> str:
    path = str(path)
    storage.write_bytes(path, gzip.compress(data) if path.endswith(".gz") else data)
    return path


def plan_with_beam(pattern: str, out: str, prompt_field: str = "prompt"):
    """Run the plan pipeline under TestPipeline: (items with image index 0, in position
    order; rejects), as written under OUT/plan."""
    settings, _ = prepare(Settings(prompts=pattern, out=out, seed=3, prompt_field=prompt_field))
    with TestPipeline() as p:
        _ = p | "Plan" >> plan.Plan(settings)
    items = [records.Item.from_json(json.loads(line)) for path in storage.glob(naming.join(out, "plan", "slices", "*"))
             for line in storage.read_text(path).splitlines()]  # noqa: E501
    rejects = [json.loads(line) for path in storage.glob(naming.join(out, "plan", "rejects", "*"))
               for line in storage.read_text(path).splitlines()]
    return sorted((i for i in items if i.image_index == 0), key=lambda i: i.position), rejects


def read(pattern: str, root: str, prompt_field: str = "prompt"):
    """(records, rejects) of the files of ``pattern``, without Beam: what the plan's passes
    see of each file (``layout.validated``). Tests with many cases use this; Beam runs are slower."""
    recs, rejects = [], []
    for path in layout.match_prompt_files(pattern):
        for _, result in layout.validated(path, 3, root, prompt_field):
            (rejects if isinstance(result, records.Reject) else recs).append(result)
    return recs, rejects


def summary(r: records.Record):
    return (r.id, r.prompt, r.negative_prompt, r.seed, r.num_images, r.guidance_scale,
            json.dumps(r.extra, sort_keys=True))


def expected_summaries():
    return [summary(records.parse_row(row, "x", 1, 3, "unused")) for row in ROWS]


@pytest.mark.parametrize("gz", ["", ".gz"])
@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "tsv", "parquet"])
def test_every_format_gives_the_same_records(tmp_path, fmt, gz):
    path = write(tmp_path / f"prompts.{fmt}{gz}", encode(fmt, ROWS))
    recs, rejects = read(path, str(tmp_path))
    assert [summary(r) for r in recs] == expected_summaries() and rejects == []
    assert [(r.source, r.line) for r in recs] == [(path, line) for line in LINES.get(fmt, range(1, 7))]


def test_all_formats_through_the_plan_pipeline(tmp_path, model_cache):
    """The plan pipeline on a folder holding every format: each file gives the same items.

    The rows go without ids and seeds here (the same id in two files is a duplicate_id
    reject), so those differ from file to file; everything else is compared."""
    fmts = ["jsonl", "json", "csv", "tsv", "parquet"]
    rows = [{k: v for k, v in row.items() if k not in ("id", "seed")} for row in ROWS]
    for fmt, gz in [(fmt, gz) for fmt in fmts for gz in ("", ".gz")]:
        write(tmp_path / "in" / f"{fmt}{gz}" / f"prompts.{fmt}{gz}", encode(fmt, rows))
    write(tmp_path / "in" / "txt" / "p.txt.gz", b"one\n\nthree\n")
    items, rejects = plan_with_beam(str(tmp_path / "in" / "**"), str(tmp_path / "out"))
    got = [(i.source.split("/")[-2], i.prompt, i.negative_prompt, i.guidance_scale, i.extra) for i in items]
    expected = [(r["prompt"], r.get("negative_prompt", ""), r.get("guidance_scale"), r.get("style") and
                 {"style": r["style"]} or {}) for r in rows]
    folders = sorted((f"{fmt}{gz}" for fmt in fmts for gz in ("", ".gz")), key=lambda f: f"{f}/prompts.{f}")
    assert got == [(folder, *e) for folder in folders for e in expected] + \
        [("txt", "one", "", None, {}), ("txt", "three", "", None, {})]
    assert [(i.id, i.line) for i in items if i.source.endswith(".txt.gz")] == [("txt/p.txt.gz:1", 1),
                                                                               ("txt/p.txt.gz:3", 3)]
    assert rejects == []


@pytest.mark.parametrize("gz", ["", ".gz"])
def test_txt_lines_are_prompts(tmp_path, gz):
    prompts = [r["prompt"].replace("\n", " ") for r in ROWS]
    path = write(tmp_path / f"p.txt{gz}", ("\n".join(prompts[:3]) + "\n\n  \r\n" + "\r\n".join(prompts[3:])).encode())
    name = os.path.basename(path)
    recs, rejects = read(path, str(tmp_path))
    assert [(r.id, r.line, r.prompt, r.seed, r.num_images) for r in recs] == [
        (f"{name}:{n}", n, prompt, records.parse_row({"prompt": prompt}, "", 0, 3, f"{name}:{n}").seed, 1)
        for n, prompt in zip([1, 2, 3, 6, 7, 8], prompts)]
    assert rejects == []


def test_prompt_field_on_csv_and_jsonl(tmp_path):
    (tmp_path / "a.csv").write_text("text,prompt,seed\nfrom csv,not the prompt,5\n,x,\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "from jsonl", "prompt": "kept"}) + "\n" +
                                      json.dumps({"prompt": "no text"}) + "\n")
    recs, rejects = read(str(tmp_path), str(tmp_path), prompt_field="text")
    assert [(r.id, r.prompt, r.seed, r.extra) for r in recs] == [
        ("a.csv:2", "from csv", 5, {"prompt": "not the prompt"}),
        ("b.jsonl:1", "from jsonl", records.parse_row({"text": "p"}, "", 0, 3, "b.jsonl:1", prompt_field="text").seed,
         {"prompt": "kept"})]
    assert [(os.path.basename(r.source), r.line, r.reason, r.message) for r in rejects] == [
        ("a.csv", 3, "empty_prompt", "'text' is empty"), ("b.jsonl", 2, "missing_prompt", "the row has no 'text' field")]


def test_bad_csv_rows_are_rejected_and_the_rest_read(tmp_path):
    data = (b"prompt,seed,num_images\r\n"
            b"ok one,1,\r\n"             # line 2: an empty optional cell is absent
            b"too,many,fields,here\r\n"  # line 3
            b"\r\n"                      # line 4: blank, not a row
            b"short\r\n"                 # line 5
            b"\xff bad utf-8,2,1\r\n"     # line 6
            b"\"multi\nline\",3,2\r\n"   # lines 7-8
            b"bad seed,x,1\r\n")         # line 9
    recs, rejects = read(write(tmp_path / "p.csv", data), str(tmp_path))
    assert [(r.line, r.prompt, r.seed, r.num_images) for r in recs] == [(2, "ok one", 1, 1), (7, "multi\nline", 3, 2)]
    assert [(r.line, r.reason) for r in rejects] == [(3, "bad_row"), (5, "bad_row"), (6, "invalid_utf8"),
                                                     (9, "bad_seed")]
    assert rejects[0].raw == "too,many,fields,here" and "4 fields" in rejects[0].message


def test_a_csv_header_with_repeated_names_rejects_the_file(tmp_path):
    recs, rejects = read(write(tmp_path / "p.tsv", b"prompt\tprompt\na\tb\n"), str(tmp_path))
    assert recs == [] and [(r.line, r.reason) for r in rejects] == [(0, "bad_header")]


@pytest.mark.parametrize("content,reason", [(b'[{"prompt": "a"}, oops]', "invalid_json"),
                                            (b'{"prompt": "a"}', "not_an_array"),
                                            (b'["a", \xff]', "invalid_utf8")])
def test_a_bad_json_file_is_one_reject(tmp_path, content, reason):
    recs, rejects = read(write(tmp_path / "p.json", content), str(tmp_path))
    assert recs == [] and [(r.line, r.reason) for r in rejects] == [(0, reason)]


def test_json_array_elements_are_checked_one_by_one(tmp_path):
    path = write(tmp_path / "p.json", json.dumps(["a string", {"prompt": "an object"}, 5, {"nope": 1}]).encode())
    recs, rejects = read(path, str(tmp_path))
    assert [(r.line, r.prompt) for r in recs] == [(1, "a string"), (2, "an object")]
    assert [(r.line, r.reason) for r in rejects] == [(3, "not_an_object"), (4, "missing_prompt")]


def test_parquet_nulls_are_absent_and_odd_types_become_json(tmp_path):
    table = pa.table({"prompt": ["a", None, "c"], "seed": pa.array([None, 2, 3], pa.int64()),
                      "guidance_scale": [None, None, 2.5],
                      "taken": [dt.datetime(2026, 1, 2, 3, 4, 5), None, None], "blob": [b"\xff\x00", None, b"ok"]})
    pq.write_table(table, str(tmp_path / "p.parquet"))
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    recs, rejects = read(str(tmp_path), str(tmp_path))
    assert [(r.line, r.prompt, r.seed, r.guidance_scale, r.extra) for r in recs] == [
        (1, "a", records.parse_row({"prompt": "a"}, "", 0, 3, "p.parquet:1").seed, None,
         {"taken": "2026-01-02T03:04:05", "blob": "/wA="}),
        (3, "c", 3, 2.5, {"blob": "ok"})]
    assert [(os.path.basename(r.source), r.line, r.reason) for r in rejects] == [
        ("broken.parquet", 0, "unreadable_file"), ("p.parquet", 2, "missing_prompt")]


def test_numeric_strings_are_numbers():
    r = records.parse_row({"prompt": "p", "seed": "7", "num_images": " 2 ", "guidance_scale": "7.5"}, "s", 1, 0, "a")
    assert (r.seed, r.num_images, r.guidance_scale) == (7, 2, 7.5)
    for bad in ("high", "nan", "1e9", ""):
        with pytest.raises(records._Bad, match="guidance_scale"):
            records.parse_row({"prompt": "p", "guidance_scale": bad}, "s", 1, 0, "a")


@pytest.mark.parametrize("name,fmt", [("a.JSONL", "jsonl"), ("x/a.csv.gz", "csv"), ("gs://b/p.tsv", "tsv"),
                                      ("a.json.gz", "json"), ("a.parquet", "parquet"), ("a.txt", "txt")])
def test_format_of(name, fmt):
    assert inputs.format_of(name) == fmt


def test_unknown_extensions_fail_the_plan_before_it_starts(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "notes.md").write_text("# notes\n")
    (tmp_path / "b.jsonl.zip").write_bytes(b"")
    with pytest.raises(plan.PlanError, match=r"notes\.md.*supported extensions: .jsonl\[.gz\].*\.parquet"):
        plan.run_plan(Settings(prompts=str(tmp_path), out=str(tmp_path / "out")))
    with pytest.raises(plan.PlanError, match=r"b\.jsonl\.zip"):
        layout.match_prompt_files(str(tmp_path))


def test_gcs_inputs(gcs_emulator, model_cache):
    base = f"gs://{gcs_emulator}/inputs/formats"
    write(f"{base}/in/p.parquet", encode("parquet", ROWS[:3]))
    write(f"{base}/in/sub/q.csv.gz", encode("csv", ROWS[3:]))
    items, rejects = plan_with_beam(f"{base}/in/**", f"{base}/out")
    assert [(i.id, i.prompt, i.seed) for i in items] == [(r.id, r.prompt, r.seed) for r in map(
        lambda row: records.parse_row(row, "x", 1, 3, "unused"), ROWS)] and rejects == []
    assert [(i.source, i.line) for i in items] == [(f"{base}/in/p.parquet", n) for n in (1, 2, 3)] + \
        [(f"{base}/in/sub/q.csv.gz", n) for n in (2, 3, 4)]


def test_the_prompt_field_is_part_of_the_fingerprint_and_checked():
    settings = Settings()
    assert fingerprint(settings.replace(prompt_field="text"), "m") != fingerprint(settings, "m")
    with pytest.raises(ValueError, match="--prompt-field"):
        settings.replace(prompt_field="").validate()


def test_cli_prompt_field_flag():
    from jobs import cli

    args = cli.build_parser().parse_args(["plan", "--prompts", "p.csv", "--prompt-field", "caption"])
    assert cli._settings(args, 1).prompt_field == "caption"
    assert cli._settings(cli.build_parser().parse_args(["plan"]), 1).prompt_field == "prompt"


def test_run_plan_end_to_end_from_csv_gz(tmp_path, model_cache):
    folder = tmp_path / "in"
    write(folder / "part-0.csv.gz", encode("csv", ROWS) + b"only,two\n")
    out = str(tmp_path / "out")
    manifest = plan.run_plan(Settings(prompts=str(folder / "*.csv.gz"), out=out, devices_per_host=2,
                                      batches_per_slice=2, seed=3))
    assert manifest == {"slice_size": 4, "slices": 2, "records": 6, "images": 8, "rejects": 1,
                        "rejects_by_reason": {"bad_row": 1}, "input_rows": 7, "input_files": 1}
    items = [records.Item.from_json(json.loads(line)) for i in range(2)
             for line in storage.read_text(naming.plan_slice(out, i)).splitlines()]
    assert [(i.id, i.image_index, i.line) for i in items] == [
        ("r1", 0, 2), ("r2", 0, 3), ("r2", 1, 3), ("r3", 0, 5), ("r4", 0, 6), ("r4", 1, 6), ("r5", 0, 7), ("r6", 0, 8)]
    assert items[0].seed == 11 and items[4].guidance_scale == 3.0 and items[4].extra == {"style": "pop"}
    [rejects] = storage.glob(naming.join(out, "plan", "rejects", "*.jsonl"))
    [reject] = [json.loads(line) for line in storage.read_text(rejects).splitlines()]
    assert (reject["line"], reject["reason"], reject["raw"]) == (9, "bad_row", "only,two")
