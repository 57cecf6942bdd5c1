import json

import pytest

from pipeline.core import keys, records


def parse(obj, line=1, raw=None):
    data = raw if raw is not None else json.dumps(obj).encode()
    return records.parse_jsonl_line(data, "in.jsonl", line, run_seed=5, auto_id=f"in.jsonl:{line}")


def test_minimal_row_gets_auto_id_and_hashed_seed():
    r = parse({"prompt": "a cat"}, line=9)
    assert isinstance(r, records.Record)
    assert (r.id, r.prompt, r.negative_prompt, r.num_images, r.guidance_scale) == ("in.jsonl:9", "a cat", "", 1, None)
    assert r.seed == keys.record_seed(5, "in.jsonl:9")


@pytest.mark.parametrize("record_id", ["", None])
def test_an_empty_id_is_treated_as_missing(record_id):
    r = parse({"prompt": "a cat", "id": record_id}, line=3)
    assert r.id == "in.jsonl:3"


@pytest.mark.parametrize("record_id", ["../../x", "a/b", "x" * 10_000, "ünïcödé 🎨", "tab\tnul\x00new\nline"])
def test_hostile_ids_are_kept_as_given(record_id):
    r = parse({"prompt": "p", "id": record_id})
    assert isinstance(r, records.Record) and r.id == record_id


def test_optional_fields_and_pass_through():
    r = parse({"prompt": "p", "id": 17, "seed": "123", "negative_prompt": "blur", "num_images": 3.0,
               "guidance_scale": 4, "style": "noir"})
    assert (r.id, r.seed, r.negative_prompt, r.num_images, r.guidance_scale) == ("17", 123, "blur", 3, 4.0)
    assert r.extra == {"style": "noir"}


@pytest.mark.parametrize("row,reason", [
    (None, "invalid_json"),
    ([1, 2], "not_an_object"),
    ({"text": "x"}, "missing_prompt"),
    ({"prompt": None}, "missing_prompt"),
    ({"prompt": 5}, "prompt_not_string"),
    ({"prompt": "  "}, "empty_prompt"),
    ({"prompt": "p", "seed": -1}, "bad_seed"),
    ({"prompt": "p", "seed": 2**63}, "bad_seed"),
    ({"prompt": "p", "seed": "abc"}, "bad_seed"),
    ({"prompt": "p", "seed": 1.5}, "bad_seed"),
    ({"prompt": "p", "num_images": 0}, "bad_num_images"),
    ({"prompt": "p", "num_images": 10**6}, "bad_num_images"),
    ({"prompt": "p", "num_images": True}, "bad_num_images"),
    ({"prompt": "p", "guidance_scale": "high"}, "bad_guidance_scale"),
    ({"prompt": "p", "guidance_scale": -1}, "bad_guidance_scale"),
    ({"prompt": "p", "id": "x" * (records.MAX_ID_CHARS + 1)}, "bad_id"),
    ({"prompt": "p", "id": {"a": 1}}, "bad_id"),
    ({"prompt": "p", "negative_prompt": 3}, "bad_negative_prompt"),
])
def test_bad_rows_are_rejected_with_a_reason(row, reason):
    raw = b"{not json" if row is None else None
    r = parse(row, line=4, raw=raw)
    assert isinstance(r, records.Reject)
    assert (r.reason, r.source, r.line) == (reason, "in.jsonl", 4)
    assert r.message and r.raw


def test_invalid_utf8_is_rejected():
    r = records.parse_jsonl_line(b'{"prompt": "\xff\xfe"}', "in.jsonl", 2, 0, "in.jsonl:2")
    assert isinstance(r, records.Reject) and r.reason == "invalid_utf8"


def test_blank_lines_are_not_rows():
    assert parse(None, raw=b"   ") is None


def test_expand_places_each_image_at_consecutive_positions():
    r = parse({"prompt": "p", "id": "r", "num_images": 3})
    items = records.expand(r, first_position=5, slice_size=4)
    assert [(i.key, i.image_index, i.position, i.slice) for i in items] == [
        ("r_0000", 0, 5, 1), ("r_0001", 1, 6, 1), ("r_0002", 2, 7, 1)]
    assert records.Item.from_json(items[0].to_json()) == items[0]
