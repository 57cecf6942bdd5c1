"""The README's promises: its demo command works from a clean clone in a fresh
virtualenv, and CI runs its test command."""
import json
import os
import re
import subprocess
import sys

import pytest

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


INSTALL = "python3 -m venv .venv && .venv/bin/pip install -e . && "


def _clean_clone_env(tmp_path):
    """(a clone of the committed tree, the environment of a fresh machine for it)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", ROOT, str(clone)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "XLA_FLAGS",
                                                           "JAX_PLATFORMS")}
    env["PROMPTMILL_CACHE"] = str(tmp_path / "cache")  # a fresh machine has no tiny model yet
    return clone, env


@pytest.mark.slow
def test_demo_command_from_a_clean_clone_in_a_fresh_virtualenv(tmp_path):
    """Clones the committed tree, runs the README's demo command there verbatim: a fresh
    virtualenv, the package's own dependencies, the job."""
    demo, _ = readme_commands()
    clone, env = _clean_clone_env(tmp_path)
    result = subprocess.run(["bash", "-c", demo], cwd=clone, env=env, capture_output=True, text=True,
                            timeout=1200)
    _check_demo(clone, result)


def test_demo_job_from_a_clean_clone(tmp_path):
    """The README's demo command after its install step, in a clean clone with an empty
    promptmill cache: the job it runs, run by this interpreter on the clone's code. (The
    install step is what ``.ci/run`` does with the test extras, and the package's imports
    are checked against its own dependencies below; the verbatim command, install
    included, is the slow test above.)"""
    demo, _ = readme_commands()
    assert demo.startswith(INSTALL) and demo[len(INSTALL):].startswith(".venv/bin/promptmill run")
    clone, env = _clean_clone_env(tmp_path)
    args = demo[len(INSTALL) + len(".venv/bin/promptmill "):].split()
    result = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=clone, env=env, capture_output=True,
                            text=True, timeout=1200)
    _check_demo(clone, result)


def _imported_distributions() -> dict[str, str]:
    """{module imported by the package (pipeline/, jobs/): the distribution that provides it}."""
    import ast
    from importlib import metadata

    names = set()
    for package in ("pipeline", "jobs"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for file in (f for f in files if f.endswith(".py")):
                for node in ast.walk(ast.parse(open(os.path.join(folder, file), encoding="utf-8").read())):
                    if isinstance(node, ast.Import):
                        names |= {alias.name for alias in node.names}
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        names |= {f"{node.module}.{alias.name}" for alias in node.names}
    # a namespace package (google.*) is told apart by its next levels
    names = {".".join(n.split(".")[:3 if n.startswith("google.cloud.") else 2 if n.startswith("google.") else 1])
             for n in names}
    names = {n for n in names if n.split(".")[0] not in sys.stdlib_module_names and n not in ("pipeline", "jobs")}
    top = metadata.packages_distributions()
    found = {}
    for name in sorted(names):
        candidates = top.get(name.split(".")[0], [])
        prefix = name.replace(".", "/") + "/"
        found[name] = candidates[0] if len(candidates) == 1 else next(
            (d for d in candidates if any(str(f).startswith(prefix) for f in metadata.files(d) or ())), None)
    return found


def _install_closure() -> set[str]:
    """The distributions ``pip install -e .`` brings: setup.py's install_requires and,
    through the installed metadata, everything they require (extras left out)."""
    import ast
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    [requires] = [ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for k in node.keywords if k.arg == "install_requires"]
    todo, seen = [Requirement(r) for r in requires], set()
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(name) or ()]
    return seen


def test_everything_the_package_imports_comes_with_its_own_install():
    """So ``pip install -e .`` without the test extras runs the job: every third-party
    module that pipeline/ and jobs/ import is provided by install_requires or by what
    those require (the test extras are not needed)."""
    from packaging.utils import canonicalize_name

    closure = _install_closure()
    assert "jax" in closure and not {"pytest", "gcp-storage-emulator", "webdataset"} & closure  # extras left out
    imported = _imported_distributions()
    assert "jax" in imported and "google.cloud.storage" in imported
    missing = {module: dist for module, dist in imported.items()
               if dist is None or canonicalize_name(dist) not in closure}
    assert not missing, f"imported but not installed by install_requires: {missing}"


def _check_demo(clone, result):
    assert result.returncode == 0, result.stderr[-4000:]
    out = clone / "promptmill-out"
    stats = json.loads((out / "dataset" / "stats.json").read_text())
    # 40 example prompts; one asks for 2 images and one for 3
    assert stats["verified"] and stats["records"] == 40 and stats["images"] == 43 and stats["rejects"] == 0
    assert len(list((out / "images").glob("*/*.png"))) == 43
    assert json.loads(result.stdout.strip().splitlines()[-1])["verified"] is True
    # with libtpu installed (the test extra has it), a local run asks for CPU devices: neither
    # the launcher nor a host goes looking for a TPU, or prints libtpu's warnings about it
    logs = [result.stderr] + [path.read_text() for path in (out / "logs").glob("host-*.log")]
    assert len(logs) == 3 and not any("TPU_ACCELERATOR_TYPE" in text or "libtpu" in text for text in logs)
