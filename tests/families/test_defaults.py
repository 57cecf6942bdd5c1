"""Every tiny built-in model runs at its defaults: `promptmill run` with nothing but the
prompts, the output folder and the model (2 hosts, the model's default size and steps),
plans, generates and collects a verified dataset. The real-size built-ins are shapes for the
TPU check and benchmarks (or, for random-sd15, minutes a run on CPU); the tiny ones are what
a new user tries first."""
import json

import pytest

from pipeline.io import runs
from pipeline.model import families, load
from tests.conftest import run_cli

TINY_SIDE = 64  # a built-in whose default images are at most this many pixels each way is a tiny one
# the tiny built-ins, by their names (read at collection, with no checkpoint built); the test
# below holds the names to what the registry says of each built-in's default size
TINY = tuple(name for name in families.runnable_builtins() if name.startswith("tiny"))


def _default_side(model: str) -> tuple[int, dict]:
    """(the side of ``model``'s images at its defaults, its family's ``Described``), from its
    configs alone: random-sd15's weights (a GiB of them) are not built to read its size."""
    directory = load.resolve(model, weights=False, shapes=True)
    family, _ = load.family_of(directory)
    described = family.describe(directory, load.request_of(model), None)
    return load.default_size(model, described.native_size), described


def test_the_tiny_built_ins_are_every_family_s(model_cache):
    """Each built-in family has a tiny model that the test below runs, and the runnable
    built-ins of a small default size are exactly those the test runs."""
    tiny = [name for name in families.runnable_builtins() if _default_side(name)[0] <= TINY_SIDE]
    assert tuple(tiny) == TINY
    assert {families.BUILTINS[name].name for name in tiny} == {family.name for family in families.BUILTIN}
    assert {"tiny", "tiny-sdxl", "tiny-flux", "tiny-flux-dev", "tiny-klein", "tiny-klein-base", "tiny-zimage"} <= \
        set(tiny)


@pytest.mark.parametrize("model", TINY)
def test_a_tiny_built_in_runs_at_its_defaults(model, tmp_path, model_cache):
    side, described = _default_side(model)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in ("a red fox", "a cat", "a whale")))
    out = str(tmp_path / "out")
    result = run_cli(["run", "--prompts", str(prompts), "--out", out, "--model", model, "--no-progress"], model_cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"images": 3, "records": 3, "rejects": 0,
                                                                  "verified": True}
    settings = runs.read(out).settings
    assert (settings.width, settings.height, settings.steps) == (side, side, described.default_steps)
    started = [json.loads(line) for line in result.stderr.splitlines() if '"event": "hosts_started"' in line]
    assert [event["hosts"] for event in started] == [2]
