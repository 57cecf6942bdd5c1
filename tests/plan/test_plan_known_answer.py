"""The plan's layout against a known answer: every ``plan/`` object, byte for byte.

Two plans of inputs that hold what the layout must get right: records spread over
files that share slices, files with rejects only and with no rows at all, rejects of
several reasons, ids repeated within a file and across files, with ``--dedupe`` a
prompt repeated (once where its earlier copy was itself dropped for its id), records of
several images, guided records, and a run of two sizes. Their ``plan/`` objects
(manifest, slices, rejects) are compared with
``tests/fixtures/plan_known_answer.json``, which the plan of promptmill at ec47c59 (the
last layout that gathered every record on one worker) wrote from the same inputs: a
layout that places, seeds, keys or rejects one record differently fails here.

Paths are relative (the test runs in its own folder), so the objects' bytes and the
rejects files' names do not depend on where the test runs.
"""
from __future__ import annotations

import json
import os

import pytest

from pipeline.core.settings import Settings
from pipeline.plan import transforms as plan
from tests.conftest import TESTS

FIXTURE = os.path.join(TESTS, "fixtures", "plan_known_answer.json")


def _jsonl(*rows) -> str:
    return "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)


# (settings, {file: text}) of each plan
PLANS = {
    "one_size_dedupe": (
        dict(dedupe=True, devices_per_host=1, batches_per_slice=3, guidance_scale=1.0),
        {
            "in/a.jsonl": _jsonl({"prompt": "a red fox", "id": "fox"}, {"prompt": "a blue whale", "num_images": 3},
                                 "{broken", {"prompt": "a red fox", "id": "fox-2"},
                                 {"prompt": "an owl", "id": "owl", "guidance_scale": 4.5, "seed": 7},
                                 {"prompt": "a cat", "id": "fox"}, {"prompt": "", "id": "blank"},
                                 {"prompt": "a dog", "negative_prompt": "blurry", "style": "ink"}),
            "in/b.jsonl": _jsonl({"prompt": "a cat", "id": "cat"}, {"prompt": "a dog", "id": "dog", "num_images": 2},
                                 {"prompt": "a moth", "id": "owl"}, {"prompt": "a moth", "id": "moth"},
                                 {"prompt": "a horse", "num_images": 0}),
            "in/c/notes.txt": "a quiet harbour\n\na quiet harbour\nan empty room\n",
            "in/d.csv": "prompt,id,seed\na lantern,lamp,3\na red fox,fox,4\n\"a storm, at sea\",storm,\n",
            "in/e.jsonl": _jsonl({"text": "no prompt here"}, {"prompt": "x", "num_images": -1}),
            "in/f.jsonl": "",
            "in/g.jsonl": _jsonl(*[{"prompt": f"a lighthouse {i}", "id": f"light-{i % 5}"} for i in range(9)]),
        },
    ),
    "two_sizes": (
        dict(sizes=("32x32", "32x48"), devices_per_host=1, batches_per_slice=2),
        {
            "in/p.jsonl": _jsonl({"prompt": "tall tower", "width": 32, "height": 48, "id": "t1"},
                                 {"prompt": "square", "id": "s1", "num_images": 3},
                                 {"prompt": "tall again", "aspect_ratio": "2:3", "id": "t2"},
                                 {"prompt": "no such size", "width": 48, "height": 48},
                                 {"prompt": "square repeat", "id": "s1"},
                                 {"prompt": "tall tree", "width": 32, "height": 48, "num_images": 2}),
            "in/q.jsonl": _jsonl({"prompt": "square two", "id": "s2"}, {"prompt": "tall two", "aspect_ratio": "2:3",
                                                                        "id": "t1"},
                                 {"prompt": "tall three", "aspect_ratio": "0.66"}, {"prompt": "square three"}),
        },
    ),
}


def planned_objects(folder: str) -> dict:
    """{name: {relative path: text}} of every ``plan/`` object (but the tables of the inputs
    and the model, which hold sizes, times and checksums of files) of each of ``PLANS``,
    planned in ``folder`` with relative paths."""
    here = os.getcwd()
    os.chdir(folder)
    try:
        found = {}
        for name, (options, files) in PLANS.items():
            for path, text in files.items():
                os.makedirs(os.path.join(name, os.path.dirname(path)), exist_ok=True)
                with open(os.path.join(name, path), "w") as f:
                    f.write(text)
            plan.run_plan(Settings(prompts=f"{name}/in", out=f"{name}/out", **options))
            objects = {}
            for root, _, names in os.walk(os.path.join(name, "out", "plan")):
                for file in names:
                    relative = os.path.relpath(os.path.join(root, file), os.path.join(name, "out"))
                    # (the plan's key index, layout 2's, came after the known answer)
                    if relative not in ("plan/inputs.json", "plan/input_cache.json", "plan/model_files.json") \
                            and not relative.startswith("plan/keys/"):
                        with open(os.path.join(root, file)) as f:
                            objects[relative] = f.read()
            # (what the manifest says of records whose settings play no part came after the known answer)
            manifest = json.loads(objects["plan/manifest.json"])
            if {"guidance_unused", "negative_prompts_unused"} & set(manifest):
                for added in ("guidance_unused", "negative_prompts_unused"):
                    manifest.pop(added, None)
                objects["plan/manifest.json"] = json.dumps(manifest, indent=2) + "\n"
            found[name] = dict(sorted(objects.items()))
        return found
    finally:
        os.chdir(here)


def test_every_plan_object_is_the_known_answer(tmp_path, model_cache):
    with open(FIXTURE) as f:
        expected = json.load(f)
    found = planned_objects(str(tmp_path))
    for name in PLANS:
        assert sorted(found[name]) == sorted(expected[name]), name
        for path, text in expected[name].items():
            assert found[name][path] == text, f"{name}: {path}"
    # the inputs hold what the known answer is meant to cover
    one = expected["one_size_dedupe"]
    manifest = json.loads(one["plan/manifest.json"])
    assert set(manifest["rejects_by_reason"]) >= {"duplicate_id", "duplicate_prompt", "invalid_json", "empty_prompt",
                                                  "missing_prompt", "bad_num_images"}
    assert manifest["slices"] > 3 and "guided_by_records" in manifest
    assert len(json.loads(expected["two_sizes"]["plan/manifest.json"])["buckets"]) == 2


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_known_answer_conserves_rows(name):
    """The fixture itself: every input row is a record or a reject, once."""
    with open(FIXTURE) as f:
        objects = json.load(f)[name]
    manifest = json.loads(objects["plan/manifest.json"])
    items = [json.loads(line) for path, text in objects.items() if path.startswith("plan/slices/")
             for line in text.splitlines()]
    rejects = [json.loads(line) for path, text in objects.items() if path.startswith("plan/rejects/")
               for line in text.splitlines()]
    assert len(items) == manifest["images"] and len({(i["id"], i["image_index"]) for i in items}) == len(items)
    assert len(rejects) == manifest["rejects"] and manifest["records"] + manifest["rejects"] == manifest["input_rows"]
    assert sorted(i["position"] for i in items) == list(range(manifest["images"]))
