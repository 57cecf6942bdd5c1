"""The README's promises: its demo command works from a clean clone in a fresh
virtualenv, and CI runs its test command."""
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from tests import docs_commands
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


def test_the_tour_from_a_clean_clone(tmp_path, monkeypatch, capsys):
    """The README's tour, each command as written, in a clean clone with an empty promptmill
    cache: its run (the demo's job, into tour-out and with a second format: tests/test_docs.py
    checks that), run by this interpreter on the clone's code, then, in this process, the
    commands that read it: status, status --watch (until the Ctrl-C pressed after its first
    report) and reproduce. The run keeps the suite's XLA flags (tests/conftest.py), so that
    reproduce here rounds as its hosts did. (The demo command verbatim, with XLA's defaults
    and its install, is the slow test above; the install step is what ``.ci/run`` does with
    the test extras, and the package's imports are checked against its own dependencies below.)"""
    from jobs import cli
    from pipeline.collect import status

    run, *reading = docs_commands.tour()
    assert [c.words()[:2] for c in reading] == [[PROMPTMILL, "status"]] * 2 + [[PROMPTMILL, "reproduce"]]
    clone, env = _clean_clone_env(tmp_path)
    result = subprocess.run([sys.executable, "-m", "jobs.cli", *run.words()[1:]], cwd=clone,
                            env=dict(env, XLA_FLAGS=os.environ["XLA_FLAGS"]), capture_output=True, text=True,
                            timeout=1200)
    _check_demo(clone, result, "tour-out", parquet=True)

    monkeypatch.chdir(clone)
    monkeypatch.setenv("PROMPTMILL_CACHE", env["PROMPTMILL_CACHE"])  # the tiny model the run built

    def ctrl_c(seconds):
        raise KeyboardInterrupt

    emit, _, rounds = status.watch.__defaults__
    monkeypatch.setattr(status.watch, "__defaults__", (emit, ctrl_c, rounds))
    capsys.readouterr()
    for command in reading:
        assert cli.main(command.words()[1:]) == 0, command
    out = capsys.readouterr().out
    assert out.count("  collect   verified: 43 images") == 2 and "slices    11/11 committed (100%)" in out
    reproduced = json.loads(out.strip().splitlines()[-1])
    assert reproduced["key"] == "lighthouse_0000" and reproduced["match"] is True
    with open(os.path.join("/tmp/again", "lighthouse_0000.png"), "rb") as saved:
        assert hashlib.sha256(saved.read()).hexdigest() == reproduced["sha256"]


PROMPTMILL = ".venv/bin/promptmill"


# modules the package imports only for an optional feature, from an extra: {module: (the
# extra, the one file that imports it)}; the seed notebook's baseline of `bench generator`
OPTIONAL_IMPORTS = {"diffusers": ("notebook", "pipeline/bench/baseline.py")}


def _imports() -> dict[str, set[str]]:
    """{module imported by the package (pipeline/, jobs/), as written: the files importing it}."""
    import ast

    names = {}
    for package in ("pipeline", "jobs"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for file in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, file)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                    if isinstance(node, ast.Import):
                        found = {alias.name for alias in node.names}
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        found = {f"{node.module}.{alias.name}" for alias in node.names}
                    else:
                        continue
                    for name in found:
                        names.setdefault(name, set()).add(os.path.relpath(path, ROOT))
    return names


def _imported_distributions() -> dict[str, str]:
    """{module imported by the package (pipeline/, jobs/), but for ``OPTIONAL_IMPORTS``:
    the distribution that provides it}."""
    from importlib import metadata

    names = {n for n in _imports() if n.split(".")[0] not in OPTIONAL_IMPORTS}
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


def test_an_optional_import_is_one_files_and_comes_with_its_extra():
    """diffusers is no dependency: only the seed notebook's baseline imports it, and the
    ``notebook`` extra installs it (neither diffusers nor transformers is in install_requires)."""
    import ast

    from packaging.requirements import Requirement

    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    keywords = {k.arg: ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                for k in node.keywords if k.arg in ("install_requires", "extras_require")}
    required = {Requirement(r).name for r in keywords["install_requires"]}
    assert not {"diffusers", "transformers"} & required
    files = {}
    for name, where in _imports().items():
        if name.split(".")[0] in OPTIONAL_IMPORTS:
            files.setdefault(name.split(".")[0], set()).update(where)
    for module, (extra, path) in OPTIONAL_IMPORTS.items():
        assert files.get(module) == {path}, (module, files.get(module))
        assert module in {Requirement(r).name for r in keywords["extras_require"][extra]}
    assert not {"transformers", "torch"} & {name.split(".")[0] for name in _imports()}
    # so a fresh `pip install -e .` brings neither, and importing the package loads neither
    assert not {"diffusers", "transformers", "torch"} & _install_closure()
    loaded = json.loads(subprocess.run(
        [sys.executable, "-c", "import json, sys, pipeline, jobs.cli; print(json.dumps(sorted(sys.modules)))"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    assert "jobs.cli" in loaded and not {"diffusers", "transformers", "torch"} & {m.split(".")[0] for m in loaded}


def _check_demo(clone, result, out="promptmill-out", parquet=False):
    assert result.returncode == 0, result.stderr[-4000:]
    out = clone / out
    stats = json.loads((out / "dataset" / "stats.json").read_text())
    # 40 example prompts; one asks for 2 images and one for 3
    assert stats["verified"] and stats["records"] == 40 and stats["images"] == 43 and stats["rejects"] == 0
    assert len(list((out / "images").glob("*/*.png"))) == 43
    assert len(list((out / "parquet").glob("*.parquet"))) == (11 if parquet else 0)
    assert json.loads(result.stdout.strip().splitlines()[-1])["verified"] is True
    # with libtpu installed (the test extra has it), a local run asks for CPU devices: neither
    # the launcher nor a host goes looking for a TPU, or prints libtpu's warnings about it
    logs = [result.stderr] + [path.read_text() for path in (out / "logs").glob("host-*.log")]
    assert len(logs) == 3 and not any("TPU_ACCELERATOR_TYPE" in text or "libtpu" in text for text in logs)
    # its stderr is a pipe here, not a terminal: no progress bar is drawn into it
    assert "\r" not in result.stderr and " img/s" not in result.stderr


# -- the README and the guides under docs/: short, linked, and naming only real flags ----------

README_MAX_LINES = 250


def _docs() -> dict[str, str]:
    """{path relative to the repository: text} of README.md and every docs/*.md."""
    paths = ["README.md"] + sorted(os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
                                   if name.endswith(".md"))
    return {path: open(os.path.join(ROOT, path), encoding="utf-8").read() for path in paths}


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def heading_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped except '-' and '_',
    spaces made '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    """The anchors of a markdown file's headings (outside code blocks), with GitHub's
    -1, -2 suffixes for repeated ones."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _without_code_blocks(markdown), flags=re.M):
        slug = heading_slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def relative_links(markdown: str) -> list[str]:
    """Markdown link targets that are not URLs (``](path)``, ``](path#anchor)``, ``](#anchor)``),
    outside code blocks."""
    targets = re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(markdown))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(path: str, markdown: str) -> list[str]:
    """The relative links of the file at ``path`` (relative to the repository) that name a
    file that does not exist, or an anchor that is no heading of the .md file they point to."""
    broken = []
    for link in relative_links(markdown):
        target, _, anchor = link.partition("#")
        file = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), target)) if target else \
            os.path.join(ROOT, path)
        if not os.path.exists(file):
            broken.append(f"{path}: {link} (no such file)")
        elif anchor and file.endswith(".md") and \
                anchor not in heading_anchors(open(file, encoding="utf-8").read()):
            broken.append(f"{path}: {link} (no such heading)")
    return broken


def test_readme_is_a_short_front_door():
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the details belong in docs/"


def test_every_relative_link_of_the_readme_and_the_guides_resolves():
    docs = _docs()
    assert len(docs) > 2 and sum(len(relative_links(text)) for text in docs.values()) > 20
    broken = [problem for path, text in docs.items() for problem in broken_links(path, text)]
    assert not broken, "\n".join(broken)


def test_link_checker_catches_a_missing_file_and_a_missing_heading():
    assert heading_slug("FLUX.1 [schnell] and [dev]") == "flux1-schnell-and-dev"
    assert heading_slug("Batch size: `--per-device-batch auto`") == "batch-size---per-device-batch-auto"
    assert heading_anchors("# A\n## Notes\n```\n# not a heading\n```\n## Notes\n") == {"a", "notes", "notes-1"}
    text = ("[ok](docs/models.md#guidance) [web](https://example.com/x#y) [gone](docs/nope.md) "
            "[bad anchor](docs/models.md#no-such-heading) [here](#quick-start) [not here](#nowhere)")
    assert relative_links(text) == ["docs/models.md#guidance", "docs/nope.md", "docs/models.md#no-such-heading",
                                    "#quick-start", "#nowhere"]
    assert broken_links("README.md", text) == ["README.md: docs/nope.md (no such file)",
                                               "README.md: docs/models.md#no-such-heading (no such heading)",
                                               "README.md: #nowhere (no such heading)"]


# a flag token: two dashes, a lowercase letter, then letters, digits, '-' and '_' (Beam's
# options are snake_case, e.g. --direct_num_workers); "---" of a table rule is none
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")

# flags the docs name that belong to other tools, or that are wrong on purpose
OTHER_TOOLS_FLAGS = {
    "--python",  # uv pip install --python .venv/bin/python, in the test command
    "--guidence-scale",  # the misspelling that promptmill refuses, in How it works
}
OTHER_TOOLS_PREFIXES = ("--xla_",)  # XLA_FLAGS, e.g. --xla_force_host_platform_device_count


def named_flags(text: str) -> set[str]:
    return set(FLAG.findall(text))


def promptmill_flags() -> set[str]:
    """Every option string of every promptmill parser, subcommands at every depth included."""
    import argparse

    from jobs import cli

    found, todo = set(), [cli.build_parser()]
    while todo:
        parser = todo.pop()
        for action in parser._actions:
            found |= set(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return found


def unknown_flags(text: str, known: set[str]) -> set[str]:
    return {flag for flag in named_flags(text)
            if flag not in known and flag not in OTHER_TOOLS_FLAGS and not flag.startswith(OTHER_TOOLS_PREFIXES)}


def test_flag_extraction():
    text = ("run `promptmill run --model tiny --per-device-batch auto --direct_num_workers 2`, "
            "XLA_FLAGS=--xla_cpu_x=1, a table rule | --- |, a key a-b--3f2c, x --dry-run, "
            "`--fsdp N` and `--no-such-flag`. -n 0 and -e stay out.")
    assert named_flags(text) == {"--model", "--per-device-batch", "--direct_num_workers", "--xla_cpu_x",
                                 "--dry-run", "--fsdp", "--no-such-flag"}
    known = {"--model", "--per-device-batch", "--direct_num_workers", "--dry-run", "--fsdp"}
    assert unknown_flags(text, known) == {"--no-such-flag"}


def test_every_flag_the_readme_and_the_guides_name_is_accepted():
    from jobs import strict

    known = promptmill_flags() | set(strict.beam_option_flags())
    assert {"--model", "--per-device-batch", "--watch", "--tpu-type", "--parts", "--save"} <= known
    assert "--direct_num_workers" in known and "--no-such-flag" not in known
    docs = _docs()
    assert sum(len(named_flags(text)) for text in docs.values()) > 100
    unknown = {path: sorted(unknown_flags(text, known)) for path, text in docs.items()}
    unknown = {path: names for path, names in unknown.items() if names}
    assert not unknown, f"flags that no promptmill parser or Beam option knows: {unknown}"
