"""The README and the guides against the code: the facts the code knows (families, built-in
models and their defaults, metadata columns, help texts) as the registry and the schema say
them, and every shell command either run as written or marked and parsed
(tests/docs_commands.py says how commands are marked). A failing table check prints the
table to paste."""
import os
import re
import subprocess

import pytest

from jobs import cli, flags, strict
from pipeline.model import families
from tests import docs_commands
from tests.conftest import ROOT


def _section(path: str, heading: str) -> str:
    """The text under ``heading`` (up to the next heading of its level or above) of one file."""
    text = docs_commands.read(path)
    level = re.search(rf"^(#+) {re.escape(heading)}$", text, flags=re.M)
    assert level, f"{path} has no heading {heading!r}"
    rest = text[level.end():]
    end = re.search(rf"^#{{1,{len(level.group(1))}}} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


# -- facts the registry knows ------------------------------------------------------------------

def builtin_rows() -> list[str]:
    """docs/models.md's table of the built-in models, a row each, from the registry: what
    each family describes of the model (from its configs alone, built once per machine)."""
    from pipeline.model.families.base import LoadRequest

    rows = []
    for name, family in families.BUILTINS.items():
        d = family.describe(families.builtin_folder(name, shapes=True), LoadRequest(name), None)
        weights = "shapes only" if name in families.shapes_only_builtins() else "random"
        rows.append(f"| `{name}` | {family.title} | {d.native_size}x{d.native_size} | {d.size_multiple} | "
                    f"{d.default_steps} | {d.default_guidance:g} | {weights} |")
    return rows


def test_the_built_in_models_table_is_the_registrys(model_cache):
    """One table of the built-ins' default sizes, size units, steps and guidance, in
    docs/models.md; each unit is its family's size rule, as --help says it."""
    table = [line for line in _section("docs/models.md", "Built-in models").splitlines() if line.startswith("| `")]
    expected = builtin_rows()
    assert table == expected, "docs/models.md's built-in models table should be:\n" + "\n".join(expected)
    for row in expected:
        name, title, _, unit = (cell.strip(" `") for cell in row.strip("|").split("|")[:4])
        family = next(f for f in families.FAMILIES if f.title == title)
        assert re.search(rf"\b{unit}\b", family.size_rule), (name, unit, family.size_rule)
    sizes = [path for path in docs_commands.doc_paths() if "| default size |" in docs_commands.read(path)]
    assert sizes == ["docs/models.md"]  # the one table of default sizes


def test_every_family_and_built_in_is_in_the_readme_and_the_models_guide():
    readme, checkpoints = docs_commands.read("README.md"), _section("docs/models.md", "Checkpoints")
    families_text, how = _section("docs/models.md", "Families"), docs_commands.read("docs/how-it-works.md")
    count = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"][len(families.FAMILIES) - 1]
    for text in (readme, checkpoints):
        assert f"one of {count} families" in text
    for family in families.FAMILIES:
        folder = type(family).__module__.split(".")[3]
        assert family.title in families_text and f"`pipeline/model/families/{folder}/`" in families_text, family.name
        assert f"`{folder}/`" in how, f"docs/how-it-works.md does not name the family folder {folder}/"
        for text in (readme, checkpoints):
            row = next((line for line in text.splitlines() if line.startswith(f"| {family.title}")), "")
            assert all(f"`{name}`" in row for name in family.pipeline_classes), (family.name, row)
        for name in family.builtins():
            assert f"`{name}`" in readme, f"the README's models table does not name {name}"
    refused = re.search(r"Any other pipeline \((.*?)\)", checkpoints, flags=re.S).group(1)
    runs = {name for family in families.FAMILIES for name in family.pipeline_classes}
    assert refused and not runs & set(re.findall(r"`(\w+)`", refused)), refused


def test_every_family_whose_prompts_are_cut_is_in_the_inputs_guide():
    fields = _section("docs/inputs.md", "Fields")
    for family in families.FAMILIES:
        assert family.title in fields, f"docs/inputs.md's Fields does not say how {family.title} cuts a prompt"


def test_every_metadata_column_is_named_in_the_output_guide():
    from pipeline.output.writer import METADATA_FIELDS

    metadata = _section("docs/output.md", "Metadata")
    missing = [name for name, _ in METADATA_FIELDS if f"`{name}`" not in metadata]
    assert not missing, f"docs/output.md's Metadata section does not name the columns {missing}"


def test_help_texts_point_at_guides_that_exist():
    helps = [action.help or "" for parser in cli.commands(cli.build_parser()) for action in parser._actions]
    named = {path for text in helps for path in re.findall(r"docs/[\w-]+\.md", text)}
    assert "docs/scores.md" in named and all(os.path.exists(os.path.join(ROOT, path)) for path in named), named
    head = next(text for text in helps if "LAION's improved aesthetic predictor" in text)
    assert "docs/scores.md" in head and "README" not in head
    assert ".pth" in docs_commands.read("docs/scores.md")  # where it says how to make the head file


# -- every shell command runs as written, or is marked and parses ---------------------------------

def test_every_fenced_block_names_its_language():
    unnamed = [f"{path}:{line}" for path in docs_commands.doc_paths()
               for language, _, line in docs_commands.fences(docs_commands.read(path))
               if language not in docs_commands.LANGUAGES]
    assert not unnamed, f"blocks without bash, text or python: {unnamed}"


# the unmarked commands outside the README's quick start and tour, each run here as written
RUN_HERE = ("mkdir -p ", "cp docs/tpu-checks/")


def test_every_command_runs_in_the_suite_or_is_marked():
    """The README's quick start: .ci/run runs the tests' command verbatim, and
    tests/test_readme.py the demo's (its job here; verbatim with -m slow); the tour's
    commands run in tests/test_readme.py, after its run; the others below."""
    elsewhere = {c.text for c in docs_commands.quick_start() + docs_commands.tour()}
    assert len(elsewhere) == 6
    loose = [str(c) for c in docs_commands.commands()
             if c.marker is None and c.text not in elsewhere and not c.text.startswith(RUN_HERE)]
    assert not loose, (f"run these commands in a test as written, or mark their block "
                       f"{' or '.join(docs_commands.MARKERS)}: {loose}")
    assert sum(c.marker is not None for c in docs_commands.commands()) > 40


def _promptmill_words(command: docs_commands.Command) -> list[str]:
    words = command.words()
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # an environment variable for the command
        words = words[1:]
    assert words[0] in ("promptmill", ".venv/bin/promptmill"), f"{command}: not a promptmill command"
    return words[1:]


@pytest.mark.parametrize("command", [c for c in docs_commands.commands() if c.marker],
                         ids=lambda c: f"{c.path}:{c.line}")
def test_every_marked_command_parses(command):
    """promptmill's own parser and flag check take it, and a run's or plan's settings flags
    make valid Settings."""
    argv = _promptmill_words(command)
    try:
        args, extra = cli.build_parser().parse_known_args(argv)
        strict.check_extra(args, extra)
    except SystemExit as e:
        raise AssertionError(f"promptmill refuses {command}") from e
    if args.command in ("run", "plan"):
        flags.settings_from_args(args, args.devices_per_host).validate()


def test_the_tpu_checks_copy_runs_as_written(tmp_path):
    [block] = [c for c in docs_commands.commands() if c.text.startswith("mkdir -p ")]
    script = "\n".join(c.text for c in docs_commands.commands() if c.line == block.line and c.path == block.path)
    assert script.startswith(RUN_HERE)
    env = dict(os.environ, PROMPTMILL_CACHE=str(tmp_path))
    subprocess.run(["bash", "-euc", script], cwd=ROOT, env=env, check=True, timeout=60)
    copied = os.listdir(tmp_path / "compile-cache" / "local" / "checks")
    assert len(copied) == len(os.listdir(os.path.join(ROOT, "docs", "tpu-checks"))) > 10


def test_the_demo_is_the_tours_run_with_its_defaults():
    """The quick start's demo (`promptmill run`, its defaults) is the tour's run but for its
    --out and --format: the tour's run, which tests/test_readme.py runs, stands for both."""
    [demo, _], run = docs_commands.quick_start(), docs_commands.tour()[0]
    demo_args = demo.text.split(" && ")[-1].split()
    assert demo_args == [".venv/bin/promptmill", "run"]
    parser = cli.build_parser()
    demo_run, tour_run = parser.parse_args(demo_args[1:]), parser.parse_args(_promptmill_words(run))
    assert (tour_run.out, tour_run.format) == ("tour-out", "files,parquet")
    assert (demo_run.hosts or 2, demo_run.devices_per_host) == (tour_run.hosts, tour_run.devices_per_host)
    demo_settings = flags.settings_from_args(demo_run, demo_run.devices_per_host)
    tour_settings = flags.settings_from_args(tour_run, tour_run.devices_per_host)
    assert demo_settings.replace(out="tour-out", formats=("files", "parquet")) == tour_settings
