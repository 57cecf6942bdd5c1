"""The README's promises: its demo command works from a clean clone in a fresh
virtualenv, and CI runs its test command."""
import json
import os
import re
import subprocess

from tests.conftest import ROOT


def readme_commands():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick_start)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    demo, tests = readme_commands()
    assert "promptmill run" in demo and "pytest" in tests
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert tests in ci


def test_demo_command_from_a_clean_clone_in_a_fresh_virtualenv(tmp_path):
    """Clones the committed tree, runs the README's demo command there verbatim."""
    demo, _ = readme_commands()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", ROOT, str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "XLA_FLAGS",
                                                           "JAX_PLATFORMS")}
    env["PROMPTMILL_CACHE"] = str(tmp_path / "cache")  # a fresh machine has no tiny model yet
    result = subprocess.run(["bash", "-c", demo], cwd=clone, env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    out = clone / "promptmill-out"
    stats = json.loads((out / "dataset" / "stats.json").read_text())
    # 40 example prompts; one asks for 2 images and one for 3
    assert stats["verified"] and stats["records"] == 40 and stats["images"] == 43 and stats["rejects"] == 0
    assert len(list((out / "images").glob("*/*.png"))) == 43
    assert json.loads(result.stdout.strip().splitlines()[-1])["verified"] is True
