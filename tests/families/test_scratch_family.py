"""The family seam holds: a family that lives in the tests (``tests/scratch_family.py``),
registered through ``PROMPTMILL_FAMILIES`` with no file of the package edited, runs
plan -> generate -> collect on 2 hosts like the package's own families."""
import json
import os

import pytest

from pipeline.collect import parts
from pipeline.core import naming
from pipeline.io import storage
from tests import scratch_family
from tests.conftest import ROOT, run_cli

PLUGIN = {"PROMPTMILL_FAMILIES": "tests.scratch_family:SCRATCH,tests.scratch_family:GUIDED"}


def test_a_family_from_outside_the_package_runs_plan_generate_collect_on_two_hosts(tmp_path, model_cache):
    """The guided scratch family: its own guidance rule (no built-in family has it) and its
    own default steps, from the plug-in alone: the plan records both, a record's guidance
    above the rule's threshold makes the run guided, the card says what the rule does, and
    ``--help`` shows the family's default."""
    from pipeline.io import runs

    lines = [{"prompt": f"scratch prompt {n}", **({"guidance_scale": 3.0} if n == 2 else {})} for n in range(5)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = str(tmp_path / "out")
    env = {**os.environ, **PLUGIN, "PYTHONPATH": ROOT}
    result = run_cli(["run", "--prompts", str(tmp_path / "p.jsonl"), "--out", out, "--model", "scratch-guided-tiny",
                      "--hosts", "2", "--devices-per-host", "1", "--per-device-batch", "1",
                      "--batches-per-slice", "1", "--no-progress"], model_cache, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = storage.read_json(naming.dataset_file(out, "stats.json"))
    assert stats["verified"] and stats["images"] == 5 and sorted(stats["hosts"]) == ["0", "1"]
    settings = runs.read(out).settings
    assert (settings.steps, settings.guidance_rule, settings.guided) == (scratch_family.GUIDED_STEPS, "scratch-half",
                                                                         True)
    rows = parts.dataset_rows(out)
    assert {row["model"] for row in rows} == {"scratch-guided-tiny"} and \
        {(row["width"], row["height"], row["steps"]) for row in rows} == {(32, 32, scratch_family.GUIDED_STEPS)}
    assert len({row["sha256"] for row in rows}) == 5  # different prompts and seeds, different images
    assert scratch_family.HALF.meaning in storage.read_text(naming.dataset_card(out))
    shown = run_cli(["run", "--help"], model_cache, env=env)
    assert shown.returncode == 0 and scratch_family.GuidedScratch.steps_help in " ".join(shown.stdout.split())


def test_without_the_plugin_the_family_is_unknown(tmp_path, model_cache):
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    env = {k: v for k, v in os.environ.items() if k != "PROMPTMILL_FAMILIES"}
    result = run_cli(["plan", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out"),
                      "--model", "scratch-tiny"], model_cache, env=env)
    assert result.returncode == 1 and "built-in random models: tiny" in result.stderr


@pytest.mark.parametrize("spec,message", [("nomodule", "must name a family as module:attribute"),
                                          ("tests.no_such_module:X", "cannot import the family"),
                                          ("tests.scratch_family:PRESETS", "is a dict, not a promptmill Family")])
def test_a_bad_plugin_is_a_clear_error(monkeypatch, spec, message):
    from pipeline.model import families

    monkeypatch.setenv(families.PLUGINS_ENV, spec)
    with pytest.raises(families.FamilyError, match=message):
        families.plugins()


def test_the_package_description_names_every_family_of_the_registry():
    import ast

    from pipeline.model import families

    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    [description] = [ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                     for k in node.keywords if k.arg == "description"]
    assert all(family.title in description for family in families.BUILTIN), (description, families.titles())
