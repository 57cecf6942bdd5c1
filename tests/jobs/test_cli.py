"""The command line: errors are one line (exit code 1, not a traceback); unknown flags are refused
(exit code 2) with the closest known flag; jobs/ and pipeline/ import one way."""
import argparse
import json
import os
import sys

import pytest

from jobs import cli, flags
from pipeline.model import families
from tests.conftest import ROOT


def test_missing_google_credentials_are_one_clear_line(monkeypatch, capsys, tmp_path):
    from google.auth.exceptions import DefaultCredentialsError

    def dispatch(args, beam_args):
        raise DefaultCredentialsError("Your default credentials were not found.")

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    # a local OUT: its lease needs no bucket (where a module before this one left the GCS emulator on)
    assert cli.main(["collect", "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("promptmill collect: error: no usable Google Cloud credentials")
    assert "credentials were not found" in err and "gcloud auth application-default login" in err


def test_other_unexpected_errors_are_not_hidden(monkeypatch):
    def dispatch(args, beam_args):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    with pytest.raises(KeyError):
        cli.main(["collect", "--out", "out"])


# ---------------------------------------------------------------- strict flags (parsing only)

GKE = ["submit", "gke", "--tpu-type", "v5e", "--topology", "2x4", "--image", "i", "--prompts", "gs://b/p.jsonl",
       "--out", "gs://b/run"]
DATAFLOW = ["submit", "dataflow", "--tpu-type", "v5e", "--topology", "2x4", "--image", "i", "--project", "p",
            "--region", "r", "--prompts", "gs://b/p.jsonl", "--out", "gs://b/run"]


@pytest.fixture
def dispatched(monkeypatch):
    """What main hands to the command: (args, beam_args); nothing runs."""
    calls = []

    def dispatch(args, beam_args):
        calls.append((args, beam_args))
        return 0

    monkeypatch.setattr(cli, "_dispatch", dispatch)
    return calls


def refused(argv, capsys) -> str:
    """main(argv) must exit 2 (argparse's usage error) before anything runs; returns stderr."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,typo,meant", [
    (["plan", "--guidence-scale", "0", "--out", "/tmp/x"], "--guidence-scale", "--guidance-scale"),
    (["run", "--out", "/tmp/x", "--guidence-scale=0"], "--guidence-scale", "--guidance-scale"),
    (["collect", "--out", "/tmp/x", "--galery-page-size", "5"], "--galery-page-size", "--gallery-page-size"),
    ([*GKE, "--max-retsarts", "2"], "--max-retsarts", "--max-restarts"),
    ([*DATAFLOW, "--harnes-threads", "2"], "--harnes-threads", "--harness-threads"),
    (["plan", "--runer", "DirectRunner"], "--runer", "--runner"),  # Beam's own options are suggested too
    (["plan", "--direct-num-workers", "2"], "--direct-num-workers", "--direct_num_workers"),
])
def test_a_mistyped_flag_is_an_error_naming_the_closest_flag(argv, typo, meant, dispatched, capsys):
    err = refused(argv, capsys)
    command = " ".join(argv[:2]) if argv[0] == "submit" else argv[0]
    assert f"promptmill {command}: error: unrecognized argument: {typo} (did you mean {meant}?); neither " \
           f"promptmill {command} nor Beam's pipeline options know it" in err
    assert dispatched == []


def test_every_unknown_flag_is_named(dispatched, capsys):
    err = refused(["plan", "--guidence-scale", "0", "--stepz", "3", "--runner", "DirectRunner"], capsys)
    assert "unrecognized arguments: --guidence-scale (did you mean --guidance-scale?), --stepz (did you mean " \
           "--steps?)" in err
    assert "--runner" not in err.splitlines()[-1]


def test_a_stray_value_is_an_error(dispatched, capsys):
    """The first value no flag takes is a command's positional OUT; any other is refused."""
    assert "unrecognized argument: 'extra'" in refused(["plan", "/tmp/x", "extra"], capsys)
    assert "unrecognized argument: 'b'" in refused(["status", "a", "--json", "b"], capsys)
    assert dispatched == []


@pytest.mark.parametrize("beam_args", [
    ["--runner", "DirectRunner", "--direct_num_workers", "2", "--direct_running_mode", "multi_processing"],
    ["--runner=DirectRunner", "--direct_num_workers=2", "--direct_running_mode=multi_processing"],
    ["--project", "p", "--region", "r", "--temp_location", "gs://b/tmp"],
    ["--experiments=x", "--experiment", "y", "--save_main_session", "--labels", "a=b"],
])
@pytest.mark.parametrize("command", [["plan"], ["run"], ["collect", "--out", "/tmp/x"]])
def test_real_beam_options_pass_through_unchanged(command, beam_args, dispatched):
    assert cli.main([*command, *beam_args]) == 0
    [(args, passed)] = dispatched
    assert passed == beam_args and args.command == command[0]


def test_submit_passes_real_beam_options_through(dispatched):
    extra = ["--worker_zone=us-west4-a", "--network", "n"]
    assert cli.main([*DATAFLOW, *extra]) == 0
    assert dispatched[0][1] == extra


def test_values_that_look_like_flags(dispatched):
    assert cli.main(["plan", "--guidance-scale", "-1", "--prompt-field=--text", "--experiments=--x",
                     "--job_name", "-2"]) == 0
    [(args, passed)] = dispatched
    assert args.guidance_scale == -1.0 and args.prompt_field == "--text"
    assert passed == ["--experiments=--x", "--job_name", "-2"]


@pytest.mark.parametrize("flag,value,typo,meant", [
    ("--plan-beam-args", "--runner DirectRunner --direct_num_worker 2", "--direct_num_worker",
     "--direct_num_workers"),
    ("--collect-beam-args", "--runner=DirectRunner --temp-location gs://b/t", "--temp-location", "--temp_location"),
])
def test_submit_gke_beam_args_strings_are_checked_by_the_same_rule(flag, value, typo, meant, dispatched, capsys):
    err = refused([*GKE, flag, value], capsys)
    expected = f"{flag} {value!r}: unrecognized argument: {typo} (did you mean {meant}?)"
    assert f"promptmill submit gke: error: {expected}; Beam's pipeline options do not know it" in err
    assert dispatched == []
    assert cli.main([*GKE, flag, "--runner DirectRunner --direct_num_workers 2"]) == 0


def test_bench_plan_beam_args_are_checked(dispatched, capsys):
    err = refused(["bench", "plan", "--beam-args", "--direct_runing_mode multi_processing"], capsys)
    assert "unrecognized argument: --direct_runing_mode (did you mean --direct_running_mode?)" in err
    assert cli.main(["bench", "plan", "--beam-args", "--direct_running_mode multi_processing"]) == 0


@pytest.mark.parametrize("argv,typo,meant", [
    (["generate", "--out", "o", "--coordinatr", "h:1"], "--coordinatr", "--coordinator"),
    (["reproduce", "k1", "--out", "o", "--svae", "d"], "--svae", "--save"),
    (["bench", "upload", "--paralel", "4"], "--paralel", "--parallel"),
    (["bench", "generator", "--matmul_size", "64"], "--matmul_size", "--matmul-size"),
])
def test_commands_without_beam_options_refuse_any_unknown_flag(argv, typo, meant, dispatched, capsys):
    err = refused(argv, capsys)
    assert f"unrecognized argument: {typo} (did you mean {meant}?)" in err
    assert dispatched == []


@pytest.mark.parametrize("argv", [["generate", "--out", "o"], ["reproduce", "k1", "--out", "o"],
                                  ["bench", "pipeline"]])
def test_commands_without_beam_options_refuse_beam_options(argv, dispatched, capsys):
    assert "unrecognized argument: --runner" in refused([*argv, "--runner", "DirectRunner"], capsys)
    assert dispatched == []


def _leaf_parsers(parser, name="promptmill"):
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield name, parser
    for action in subs:
        for command, child in action.choices.items():
            yield from _leaf_parsers(child, f"{name} {command}")


def test_every_command_is_checked_and_only_the_beam_commands_take_beam_options():
    beam = {}
    for name, parser in _leaf_parsers(cli.build_parser()):
        assert parser.get_default("flags_parser_") is parser, f"{name} is not marked with flags.strict"
        beam[name] = parser.get_default("flags_beam_")
    assert {name for name, takes in beam.items() if takes} == {
        "promptmill run", "promptmill plan", "promptmill collect", "promptmill submit dataflow",
        "promptmill submit gke"}
    assert len(beam) == 16  # with status, bench collect, bench status, bench tpu and bench sizes


def test_beam_option_flags_are_beams_own():
    from jobs import strict

    known = strict.beam_option_flags()
    assert {"--runner", "--direct_num_workers", "--direct_running_mode", "--project", "--region",
            "--temp_location", "--experiments", "--experiment", "--worker_zone", "--sdk_container_image"} <= known
    assert "--guidance-scale" not in known and "--help" not in known


# ---------------------------------------------------------------- no abbreviations, no last-wins


@pytest.mark.parametrize("argv,message", [
    (["plan", "--prompts", "a.jsonl", "--prompts", "b.jsonl"], "--prompts given twice (a.jsonl and b.jsonl)"),
    (["plan", "--steps", "1", "--steps=2"], "--steps given twice (1 and 2)"),
    (["run", "--model", "tiny", "--model", "tiny-flux"], "--model given twice (tiny and tiny-flux)"),
    (["plan", "--steps", "2", "--steps", "2"], "--steps given twice (2 and 2)"),  # even the same value
    (["plan", "--dedupe", "--dedupe"], "--dedupe given twice: give it once"),
    (["plan", "--format", "files", "--format", "zarr"], "--format given twice (files and zarr)"),
    (["run", "--score", "clip", "--score=safety"], "--score given twice (clip and safety)"),
    (["plan", "--per-device-batch", "auto", "--per-device-batch", "2"], "--per-device-batch given twice (auto and 2)"),
    ([*DATAFLOW, "--project", "q"], "--project given twice (p and q)"),
    ([*DATAFLOW, "--region=s"], "--region given twice (r and s)"),
    ([*GKE, "--out", "gs://b/other"], "--out given twice (gs://b/run and gs://b/other)"),
    (["generate", "--out", "a", "--host-id", "0", "--host-id", "1"], "--host-id given twice (0 and 1)"),
    (["status", "o", "--json", "--json"], "--json given twice: give it once"),
    (["bench", "plan", "--report", "a.json", "--json", "b.json"],
     "--report and --json are one flag, given twice (a.json and b.json): give it once"),
    # Beam's single-valued options, which promptmill passes on: Beam would keep the last
    (["plan", "--runner", "DirectRunner", "--runner=DataflowRunner"],
     "--runner given twice (DirectRunner and DataflowRunner): give it once"),
    ([*DATAFLOW, "--worker_zone", "a", "--worker_zone", "b"], "--worker_zone given twice (a and b)"),
    (["plan", "--machine_type", "a", "--worker_machine_type", "b"],
     "--machine_type and --worker_machine_type are one flag, given twice (a and b)"),
    ([*GKE, "--plan-beam-args", "--runner DirectRunner --runner DirectRunner"],
     "--plan-beam-args '--runner DirectRunner --runner DirectRunner': --runner given twice"),
])
def test_a_flag_that_takes_one_value_given_twice_is_refused_naming_both(argv, message, dispatched, capsys):
    err = refused(argv, capsys)
    assert message in err and "error: " in err, err
    assert dispatched == []


def test_flags_that_accumulate_still_do(dispatched):
    assert cli.main(["plan", "--lora", "a.safetensors", "--lora", "b@0.5", "--experiments=x", "--experiment",
                     "y"]) == 0
    [(args, beam_args)] = dispatched
    assert args.lora == ["a.safetensors", "b@0.5"] and beam_args == ["--experiments=x", "--experiment", "y"]


def _value_for(action) -> list[str]:
    if action.nargs == 0:
        return []
    return [str(list(action.choices)[0])] if action.choices else ["1"]


def test_every_single_valued_flag_of_every_command_is_taken_once():
    """Each store flag (store, store_true, store_const, store_false) of every command: once is
    fine, twice is an error naming the flag; and no command takes abbreviations."""
    import argparse

    from jobs import flags

    checked = 0
    top = cli.build_parser()
    for name, parser in _leaf_parsers(top):
        assert parser.allow_abbrev is False and isinstance(parser, flags.Parser), name
        path = name.split()[1:]
        for action in parser._actions:
            if not action.option_strings or not isinstance(action, (argparse._StoreAction,
                                                                    argparse._StoreConstAction)):
                continue
            assert isinstance(action, flags._Once), f"{name} {action.option_strings[0]}"
            flag, value = action.option_strings[-1], _value_for(action)
            with pytest.raises(SystemExit) as e:
                top.parse_known_args([*path, flag, *value, flag, *value])
            assert e.value.code == 2, f"{name} {flag}"
            checked += 1
    assert checked > 150


def test_twice_is_reported_as_the_cli_reports_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--steps", "1", "--steps", "2"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "promptmill plan: error: --steps given twice (1 and 2): give it once"


@pytest.mark.parametrize("argv,abbreviation,meant", [
    (["plan", "--ste", "1"], "--ste", "--steps"),
    (["plan", "--step", "1"], "--step", "--steps"),
    (["run", "--host", "2"], "--host", "--hosts"),
    (["plan", "--prompt", "x"], "--prompt", "--prompts or --prompt-field"),
    ([*GKE, "--max-restart", "2"], "--max-restart", "--max-restarts"),
    ([*DATAFLOW, "--proj", "p2"], "--proj", "--project"),
    (["generate", "--out", "o", "--coord", "h:1"], "--coord", "--coordinator"),
    # an abbreviation of a Beam option is refused before Beam sees it
    (["plan", "--direct_num", "2"], "--direct_num", "--direct_num_workers"),
    (["collect", "--out", "o", "--temp_loc", "gs://b/t"], "--temp_loc", "--temp_location"),
])
def test_abbreviations_are_refused_naming_the_flag(argv, abbreviation, meant, dispatched, capsys):
    err = refused(argv, capsys)
    assert f"unrecognized argument: {abbreviation} (did you mean {meant}?)" in err
    assert dispatched == []


def test_an_abbreviation_in_a_beam_options_string_is_refused(dispatched, capsys):
    err = refused([*GKE, "--collect-beam-args", "--run DirectRunner"], capsys)
    assert "--collect-beam-args '--run DirectRunner': unrecognized argument: --run (did you mean --runner" in err


@pytest.mark.parametrize("argv,unknown,meant", [
    (["plan", "--frobnicate"], "--frobnicate", None),  # nothing close: no guess, and never a Beam option first
    (["plan", "--stpes", "3"], "--stpes", "--steps"),
    (["plan", "--guidance_scale", "3"], "--guidance_scale", "--guidance-scale"),  # Beam's style for ours
    (["plan", "--job-name", "x"], "--job-name", "--job_name"),  # ours for Beam's: plan has no --job-name
    (["plan", "--runer", "DirectRunner"], "--runer", "--runner"),  # no flag of ours is close
])
def test_suggestions_come_from_our_flags_before_beams(argv, unknown, meant, dispatched, capsys):
    err = refused(argv, capsys)
    line = err.splitlines()[-1]
    if meant is None:
        assert f"unrecognized argument: {unknown};" in line and "did you mean" not in line
    else:
        assert f"unrecognized argument: {unknown} (did you mean {meant}?)" in line


def test_device_memory_is_refused_only_where_nothing_reads_it():
    from jobs import flags

    parser = cli.build_parser()
    args = parser.parse_args(["run", "--per-device-batch", "4", "--device-memory", "16"])
    with pytest.raises(ValueError, match="--device-memory is read only by --per-device-batch auto and --fsdp auto"):
        flags.settings_from_args(args, 1)
    args = parser.parse_args(["run", "--fsdp", "auto", "--per-device-batch", "4", "--device-memory", "16"])
    assert flags.settings_from_args(args, 2).device_memory == 16.0  # --fsdp auto reads it
    # a plan keeps it in run.json, for the TPU check a submission repeats after its plan
    args = parser.parse_args(["plan", "--per-device-batch", "4", "--device-memory", "16"])
    assert flags.settings_from_args(args, 1, tpu_check=True).device_memory == 16.0


# ---------------------------------------------------------------- one-way imports

def _imports(path: str) -> set[str]:
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_pipeline_imports_nothing_of_jobs_and_only_cli_imports_cli():
    import glob

    root = ROOT
    pipeline_files = glob.glob(os.path.join(root, "pipeline", "**", "*.py"), recursive=True)
    assert len(pipeline_files) > 20
    for path in pipeline_files:
        bad = {name for name in _imports(path) if name == "jobs" or name.startswith("jobs.")}
        assert not bad, f"{os.path.relpath(path, root)} imports {sorted(bad)}"
    for path in glob.glob(os.path.join(root, "jobs", "*.py")):
        if not path.endswith("cli.py"):
            assert "jobs.cli" not in _imports(path), f"{os.path.relpath(path, root)} imports jobs.cli"


def test_lora_flags_are_repeatable_and_a_bad_spec_is_one_clear_line(tmp_path, capsys):
    from jobs import flags

    args = cli.build_parser().parse_args(["plan", "--lora", "style.safetensors", "--lora", "gs://b/lcm@0.5"])
    settings = flags.settings_from_args(args, 1)
    assert settings.loras == ("style.safetensors@1.0", "gs://b/lcm@0.5")  # in order, scales made explicit
    assert flags.settings_from_args(cli.build_parser().parse_args(["plan"]), 1).loras == ()
    assert cli.main(["plan", "--out", str(tmp_path), "--lora", "style.safetensors@strong"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("promptmill plan: error: --lora style.safetensors@strong: the scale after '@' must be a "
                          "number, got 'strong'") and err.count("\n") == 1


def _subparsers(parser, prefix=()):
    """(command path, parser) of every parser under ``parser``, itself included."""
    found = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _subparsers(child, prefix + (name,))
    return found


def test_a_flag_that_several_commands_take_means_the_same_in_each():
    """Its type, choices, number of values, action and destination agree wherever it is
    taken (a command's help may add what it does with it; a default may differ). The
    benchmarks are left out: their flags sweep several values of a setting (``--per-device-batch
    1,2,4``) and size synthetic inputs (``--prompts 1000000``)."""
    meanings: dict[str, dict] = {}
    for path, parser in _subparsers(cli.build_parser()):
        if path[:1] == ("bench",):
            continue
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help"):
                    continue
                meaning = (type(action).__mro__[1].__name__ if type(action).__name__.endswith("Once") else
                           type(action).__name__, action.dest, action.type, tuple(action.choices or ()), action.nargs,
                           action.const)
                meanings.setdefault(flag, {})[" ".join(path)] = meaning
    differ = {flag: by for flag, by in meanings.items() if len(set(by.values())) > 1}
    assert differ == {}, differ
    assert len([flag for flag, by in meanings.items() if len(by) > 1]) > 20  # the test reads many shared flags


# every command that works on one run, as given before its OUT (reproduce's positional arguments are keys)
ONE_RUN = [["run"], ["plan"], ["generate"], ["collect"], ["status"], GKE[:-2], DATAFLOW[:-2]]


@pytest.mark.parametrize("command", ONE_RUN, ids=lambda c: " ".join(c[:2]))
def test_every_command_on_one_run_takes_out_as_its_positional_argument_or_as_out(command, dispatched, capsys,
                                                                                   tmp_path):
    out = "gs://b/run-1" if command[0] == "submit" else str(tmp_path / "run-1")  # a local one for the lease
    for argv in ([*command, out], [*command, "--out", out], [*command, out, "--out", out], [out, *command]):
        if argv[0] == out:  # the positional may come after the flags too
            argv = [*command, "--log-level", "info", out]
        assert cli.main(argv) == 0, argv
        assert dispatched[-1][0].out == out and dispatched[-1][1] == [], argv
    err = refused([*command, out, "--out", "gs://b/other"], capsys)
    assert f"error: OUT given twice, as {out} and as --out gs://b/other: give it once" in err
    if command[0] not in ("run", "plan"):  # those two have a default OUT
        assert "error: the run's OUT is missing" in refused(command, capsys)
    assert "[OUT]" in cli.build_parser().parse_known_args([*command, out])[0].flags_parser_.format_usage()


@pytest.mark.parametrize("command", [["run"], ["collect"], GKE[:-2]], ids=lambda c: " ".join(c[:2]))
def test_the_value_of_a_beam_option_is_never_taken_for_out(command, dispatched, tmp_path):
    """argparse would hand the value of a flag it does not know to a positional argument."""
    out = "gs://b/run-1" if command[0] == "submit" else str(tmp_path / "run-1")
    assert cli.main([*command, "--project", "p", out, "--save_main_session", "--region", "r"]) == 0
    args, beam_args = dispatched[-1]
    assert args.out == out and beam_args == ["--project", "p", "--save_main_session", "--region", "r"]


def test_status_reads_out_given_either_way(tmp_path, capsys):
    for argv in (["status", str(tmp_path / "none")], ["status", "--out", str(tmp_path / "none")]):
        assert cli.main(argv) == 1
        assert f"{tmp_path / 'none'}/run.json does not exist" in capsys.readouterr().err  # it looked in that folder


def test_every_command_with_out_takes_date(dispatched):
    """docs/cloud-tpu.md: every command with --out takes --date (the benchmarks' --out is another thing)."""
    dated = {" ".join(path): any("--date" in a.option_strings for a in p._actions)
             for path, p in _subparsers(cli.build_parser())
             if path[:1] != ("bench",) and any("--out" in a.option_strings for a in p._actions)}
    assert len(dated) == 8 and all(dated.values()), dated
    assert cli.main(["status", "--date", "2026-11-20", "runs/{date}"]) == 0
    assert dispatched[-1][0].out == "runs/2026-11-20"


def test_version(capsys):
    from pipeline import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"promptmill {__version__}\n"


def test_a_size_is_refused_by_its_models_family_in_the_words_of_the_help(tmp_path, model_cache, capsys):
    """--width 24 on FLUX.2 [klein]: its unit (16), as --help says it; --sizes with a lone
    --width names what was given."""
    width_help = next(a.help for a in cli.build_parser()._subparsers._group_actions[0].choices["plan"]._actions
                      if "--width" in a.option_strings)
    rule = families.BY_NAME["flux2"].size_rule
    assert f"FLUX.2 [klein] and Z-Image: {rule}" in width_help and "16" in rule
    assert cli.main(["plan", "--model", "random-klein-4b", "--width", "24", "--out", str(tmp_path / "a")]) == 1
    assert f"--width 24: random-klein-4b's images are multiples of 16 pixels each way (FLUX.2 [klein]'s size unit: " \
           f"{rule})" in capsys.readouterr().err
    assert cli.main(["plan", "--sizes", "64x64", "--width", "32", "--out", str(tmp_path / "b")]) == 1
    assert "--sizes 64x64 and --width 32: give one" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "tiny", "--max-sequence-length", "64", "--out", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert "--max-sequence-length 64: SD 1.x/2.x's CLIP text encoders take 77 tokens" in err and "T5" not in err


def test_the_steps_help_has_every_familys_default():
    steps_help = next(a.help for a in cli.build_parser()._subparsers._group_actions[0].choices["plan"]._actions
                      if "--steps" in a.option_strings)
    for family in families.FAMILIES:
        assert family.title in steps_help and f": {family.steps_help}" in steps_help, family.title
    assert "Z-Image: 50" in steps_help and "[schnell] 4, [dev] 28" in steps_help


def test_run_takes_the_gallery_flags_and_date_helps_say_what_each_command_does():
    parser = cli.build_parser()
    args = parser.parse_args(["run", "--gallery-max", "5", "--gallery-order", "aesthetic", "--gallery-page-size", "7",
                              "--part-rows", "3"])
    assert flags.gallery_of(args) == {"page_size": 7, "gallery_max": 5, "gallery_order": "aesthetic", "part_rows": 3}
    helps = {" ".join(path): next(a.help for a in p._actions if "--date" in a.option_strings)
             for path, p in _subparsers(parser) if any("--date" in a.option_strings for a in p._actions)}
    assert "resumes it" in helps["run"] and "resumes it" in helps["plan"]
    assert helps["collect"].endswith("the dated run to collect")
    assert helps["reproduce"].endswith("the dated run whose images to regenerate")


def test_beams_apitools_warning_is_dropped_and_nothing_else(tmp_path):
    """Beam warns on the root logger when apitools is missing; every command used to print
    it. The filter drops that one line at its source and keeps every other warning."""
    import subprocess

    code = ("import logging, jobs.cli\n"
            "import apache_beam.io.gcp.internal.clients.bigquery\n"
            "logging.warning('apitools not found, and bigquery client libraries are not available')\n"
            "logging.warning('a warning of someone else')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "apitools" not in done.stderr
    assert "a warning of someone else" in done.stderr


def test_every_command_takes_log_level_and_quiet(dispatched):
    for argv in (["run"], ["plan"], ["collect", "--out", "o"], ["status", "o"], ["bench", "generator"],
                 ["submit", "gke", "--prompts", "p", "--out", "o"]):
        assert cli.main([*argv, "--quiet", "--log-level", "debug"]) == 0, argv
        args = dispatched[-1][0]
        assert args.quiet and args.log_level == "debug"
    assert cli.main(["run"]) == 0
    assert not dispatched[-1][0].quiet and dispatched[-1][0].log_level == "info"


def test_a_finished_run_says_what_it_wrote_dropped_and_rejected_unless_quiet(tmp_path, monkeypatch, capsys):
    from pipeline.engines import local as launcher

    stats = {"images": 6, "records": 8, "rejects": 2, "verified": True, "dropped": {"images": 1}}
    seen = []

    def run_local(settings, hosts, beam_args, progress, compile_cache, overwrite, gallery=None):
        seen.append(progress)
        return stats

    monkeypatch.setattr(launcher, "run_local", run_local)
    out = str(tmp_path / "out")
    assert cli.main(["run", "--out", out, "--no-compile-cache"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {k: stats[k] for k in cli.SUMMARY}
    err = captured.err
    assert "6 image(s) in the dataset, 1 dropped by filters, 2 input row(s) rejected" in err
    assert f"{out}/plan/rejects/" in err and f"{out}/ (its card README.md; dataset/" in err and "verified" in err
    assert f"promptmill status {out}" in err
    assert cli.main(["run", "--out", out, "--no-compile-cache", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["images"] == 6 and "in the dataset" not in captured.err
    assert seen == [True, False]  # --quiet also turns the progress bar off


def test_a_runs_summary_counts_what_this_attempt_made():
    """A resumed run says what it made and at what rate, beside what the dataset holds; a
    finished one that nothing remained to make says so."""
    stats = {"images": 60, "rejects": 0, "verified": True}
    resumed = {**stats, "attempt": {"images_made": 36, "generate_s": 12.0, "slices_generated": 9, "slices_redone": 0,
                                    "slices_skipped": 6}}
    text = cli.summary("run", "o", resumed, 20.0)
    assert "36 image(s) made (24 made before), 60 in the dataset" in text and "3.00 images/s generating" in text
    finished = {**stats, "attempt": {"images_made": 0, "generate_s": 0.0, "slices_generated": 0, "slices_redone": 0,
                                     "slices_skipped": 0}}
    text = cli.summary("run", "o", finished, 3.0)
    assert "finished already: 60 image(s) in the dataset, none made now" in text and "images/s" not in text
    assert "60 image(s) in the dataset, 0 dropped" in cli.summary("collect", "o", stats, 2.0)
    unused = {**stats, "truncated_prompts": {"records": 2, "images": 3}, "guidance_unused": {"records": 1, "images": 1},
              "negative_prompts_unused": {"records": 0, "images": 0}}
    lines = cli.summary("collect", "o", unused, 2.0).splitlines()
    assert "  note: 2 prompt(s) longer than the text encoder reads were cut to its length" in lines[2]
    assert "  note: 1 record(s) gave a guidance_scale the model takes none of: unused" in lines[3]
    assert not any("negative" in line for line in lines)


@pytest.mark.parametrize("command", ["run", "collect"])
def test_the_json_summary_is_the_last_line_in_a_terminal_too(command, tmp_path, monkeypatch):
    """In a terminal stdout and stderr are one stream: the summary for people comes first."""
    import io

    from pipeline.collect import transforms as collect
    from pipeline.engines import local as launcher

    stats = {"images": 6, "records": 8, "rejects": 2, "verified": True}
    monkeypatch.setattr(launcher, "run_local", lambda *a, **k: stats)
    monkeypatch.setattr(collect, "run_collect", lambda *a, **k: stats)
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main([command, "--out", str(tmp_path / "out")] + (["--no-compile-cache"] if command == "run" else [])) == 0
    lines = terminal.getvalue().splitlines()
    assert "6 image(s) in the dataset" in "\n".join(lines[:-1])
    assert json.loads(lines[-1]) == stats


def test_quiet_promises_only_what_each_command_does():
    helps = {name: next(a.help for a in p._actions if "--quiet" in a.option_strings)
             for name, p in _leaf_parsers(cli.build_parser())}
    assert "no progress bar, no summary" in helps["promptmill run"]
    assert "no summary" in helps["promptmill collect"] and "progress bar" not in helps["promptmill collect"]
    for name in ("status", "reproduce", "generate", "plan", "submit gke", "bench tpu"):
        assert helps[f"promptmill {name}"] == "warnings and errors only: no info events", name


def test_the_summary_says_not_verified_and_no_rejects_path_when_there_are_none():
    text = cli.summary("collect", "gs://b/run/", {"images": 0, "rejects": 0, "verified": False}, 0.0)
    assert "NOT verified" in text and "rejects/" not in text and "images/s" not in text
    assert "dataset: gs://b/run/ (its card README.md" in text


@pytest.mark.parametrize("body, code, printed", [
    ("atexit.register(lambda: print('exit handler ran', flush=True)); return 3", 3, "exit handler ran"),
    ("raise SystemExit(2)", 2, ""),
    ("raise SystemExit('a message')", 1, "a message"),
    ("raise LookupError('not caught')", 1, "LookupError: not caught"),
])
def test_the_command_ends_with_mains_code_after_every_exit_handler(body, code, printed):
    """``promptmill`` (``cli.entry``) skips the interpreter's teardown of the libraries, not
    the exit handlers a command registered, nor main's exit code."""
    import subprocess

    script = (f"import atexit\nfrom jobs import cli\ndef main():\n    {body}\ncli.main = main\ncli.entry()\n"
              "print('not reached')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert printed in done.stdout + done.stderr and "not reached" not in done.stdout


def test_the_installed_command_is_the_entry():
    from importlib import metadata

    [script] = [e for e in metadata.entry_points(group="console_scripts") if e.name == "promptmill"]
    assert script.value == "jobs.cli:entry"


def test_importing_the_command_registers_no_exit_handler_that_its_end_would_skip():
    """``cli.entry`` registers its end first, so an exit handler registered while
    ``jobs.cli`` itself is imported would run after it, that is never: there is none but
    logging's, whose shutdown the end does itself."""
    import subprocess

    script = ("import atexit, logging\nfrom unittest import mock\nseen = []\n"
              "with mock.patch.object(atexit, 'register', side_effect=lambda f, *a, **k: seen.append(f) or f):\n"
              "    import jobs.cli\nprint(len(seen), [getattr(f, '__qualname__', f) for f in seen])\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 []"
