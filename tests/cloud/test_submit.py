"""promptmill submit dataflow|gke, what the two share: job names, every setting carried to the
plan (a plan command, the Dataflow plan job, what a dry run prints), bf16 by default, bad input;
and the arguments and helpers that tests/cloud/test_submit_gke.py and test_submit_dataflow.py use.
The fake kubectl and Dataflow launcher are fixtures of tests/cloud/conftest.py."""
import argparse
import dataclasses
import json
import re
import shlex

import pytest

from pipeline.cloud import checks, dataflow, gke, tpu
from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage

OUT = "gs://bucket/runs/x"
PROMPTS = "gs://bucket/prompts/*.jsonl"
IMAGE = "us-docker.pkg.dev/p/r/promptmill:1"


def test_job_names_follow_out_and_carry_the_date():
    assert checks.job_name(OUT) == checks.job_name(OUT + "/") != checks.job_name(OUT + "2")
    assert re.fullmatch(r"promptmill-[0-9a-f]{8}", checks.job_name(OUT))
    assert checks.job_name(OUT, "Nightly_SD", "2025-01-31T23:30:00-02:00") == "nightly-sd-20250201"


# Every Settings field at a value other than its default, valid (Settings.validate): what a plan
# command and the Dataflow plan job carry, and must read back as they are.
ALL_CHANGED = Settings(
    prompts=PROMPTS, out=OUT, model="gs://b/models/sd", unet="gs://b/unet.safetensors",
    loras=("gs://b/loras/style@0.75", "gs://b/lcm.safetensors@1.0"), width=64, height=48, steps=7,
    sizes=("64x48", "48x64"), bucket_batches=(3, 2),
    scheduler="dpmpp", timestep_spacing="trailing", guidance_scale=3.25, max_sequence_length=256, seed=12,
    per_device_batch=3, device_memory=15.5, batches_per_slice=3, devices_per_host=8, fsdp=2, dtype="bf16",
    decode_batch=2, attention="chunked", formats=("files", "zarr"), image_format="webp", quality=80, save_latents=True,
    prompt_field="text", dedupe=True, guidance_rule="zimage", guided=True, scores=("clip", "aesthetic", "safety"),
    clip_model="gs://b/clip", aesthetic_head="gs://b/a.safetensors", safety_checker="gs://b/sd",
    min_clip_similarity=0.28, min_aesthetic=5.5, drop_nsfw=True).validate()


def _flag_fields(settings: Settings) -> Settings:
    """``settings`` with the fields that are no flag (gke.NOT_FLAGS) at their defaults: what a plan reads back."""
    return settings.replace(**{f.name: f.default for f in dataclasses.fields(Settings) if f.name in gke.NOT_FLAGS})


def _plan_parser():
    from jobs import cli

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["plan"]


def test_every_settings_field_is_a_plan_flag_or_said_not_to_be():
    """A new Settings field fails here until it is a flag of `promptmill plan` (read back by
    settings_from_args) or listed in gke.NOT_FLAGS with the reason; and ALL_CHANGED changes it."""
    names = [f.name for f in dataclasses.fields(Settings)]
    unchanged = [f.name for f in dataclasses.fields(Settings) if getattr(ALL_CHANGED, f.name) == f.default]
    assert unchanged == [], f"give ALL_CHANGED a value other than the default for {unchanged}"
    assert set(gke.NOT_FLAGS) <= set(names) and all(gke.NOT_FLAGS.values())
    actions = {flag: action for action in _plan_parser()._actions for flag in action.option_strings}
    for name in names:
        if name in gke.NOT_FLAGS:
            assert gke.setting_flag(name) not in actions, f"{name} is a flag: take it out of gke.NOT_FLAGS"
            continue
        flag = gke.setting_flag(gke.WITHIN.get(name, name))  # a field written within another's flag
        assert flag in actions, f"Settings.{name}: promptmill plan has no {flag}; add the flag or list it in NOT_FLAGS"
        assert actions[flag].dest == flag[2:].replace("-", "_")
        # what an absent flag reads back as is the field's default (settings_flags leaves out None and ())
        default = dataclasses.fields(Settings)[names.index(name)].default
        if (default is None or default == () or default is False) and name not in gke.WITHIN:
            assert actions[flag].default in (None, "", False), flag
    assert {gke.setting_flag(n) for n in names if n not in gke.NOT_FLAGS} >= {
        "--fsdp", "--device-memory", "--guidance-scale", "--max-sequence-length", "--devices-per-host", "--lora"}


def _no_lease(args):
    import contextlib

    return contextlib.nullcontext()


def test_plan_command_round_trips_every_setting_through_the_cli(monkeypatch):
    """GKE's plan command, run by the real CLI (planning faked), plans the same settings."""
    from jobs import cli

    planned = []
    monkeypatch.setattr("pipeline.plan.transforms.run_plan",
                        lambda settings, beam_args, overwrite, cap: planned.append((settings, beam_args)) or {})
    monkeypatch.setattr("jobs.cli._lease", _no_lease)  # nothing is planned: no OUT is written
    monkeypatch.setattr("pipeline.generate.fit.resolve_per_device_batch", lambda settings, overwrite: settings)
    monkeypatch.setattr("pipeline.generate.fit.cap_hosts", lambda settings, hosts, overwrite: None)
    for settings in (ALL_CHANGED, Settings(prompts=PROMPTS, out=OUT), Settings(fsdp=2, devices_per_host=4),
                     Settings(per_device_batch="auto", fsdp="auto", device_memory=16, devices_per_host=4),
                     Settings(prompts="-odd name.jsonl", prompt_field="--text", seed=2**63 - 1)):
        command = gke.plan_command(settings, ["--runner", "DirectRunner"])
        assert command[:2] == ["promptmill", "plan"] and command[-2:] == ["--runner", "DirectRunner"]
        assert cli.main(command[1:]) == 0
        assert planned.pop() == (_flag_fields(settings), ["--runner", "DirectRunner"])
    command = gke.plan_command(Settings(fsdp=2, devices_per_host=4, device_memory=15.5))
    assert ("--fsdp", "2") in zip(command, command[1:]) and ("--device-memory", "15.5") in zip(command, command[1:])
    # defaults are written out too: a plan reads the same settings whatever its own defaults
    assert ("--dtype", "fp32") in zip(command, command[1:]) and "--save-latents" not in command


def test_settings_the_flags_cannot_say_are_refused():
    with pytest.raises(ValueError, match="formats=\\(\\) cannot be given as flags"):
        gke.settings_flags(Settings(formats=()))
    with pytest.raises(ValueError, match="prompts=None cannot be given as flags"):
        gke.settings_flags(Settings(prompts=None))


def test_the_dataflow_plan_job_reads_back_every_setting():
    """The Dataflow plan job's launcher arguments, read by the real launcher's parser, give the same settings."""
    from jobs import dataflow_launcher

    for settings in (ALL_CHANGED, Settings(out=OUT, fsdp=2, devices_per_host=8)):
        job = _dataflow_job(OUT, settings=settings, overwrite=True, cap_hosts=2)
        args, options = dataflow_launcher.parse(dataflow.stage_arguments(job, "plan"))
        assert (args.command, args.stage, args.out, args.overwrite, args.cap_hosts) == ("run", "plan", OUT, True, 2)
        assert options == list(job.options("plan"))
        assert dataflow_launcher.plan_settings(args) == _flag_fields(settings)


# ---------------------------------------------------------------- the CLI


def cli_main(argv, capsys):
    """Exit code, stdout, stderr of ``promptmill ARGV``."""
    from jobs import cli

    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# The TPU check (tests/generate/test_tpu_check.py) compiles for a minute; these tests are about the rest
DATAFLOW = ["submit", "dataflow", "--tpu-type", "v5e", "--topology", "2x4", "--image", IMAGE, "--project", "p",
            "--region", "us-west4", "--out", OUT, "--prompts", PROMPTS, "--steps", "4", "--no-tpu-check"]
GKE = ["submit", "gke", "--tpu-type", "v5e", "--topology", "4x4", "--image", IMAGE, "--out", OUT,
       "--prompts", PROMPTS, "--steps", "4", "--no-tpu-check"]


def given(argv: list[str], *pairs: str) -> list[str]:
    """``argv`` with each FLAG VALUE of ``pairs`` in place of that flag's value where ``argv``
    has it, else appended: a flag given twice is an error, never last-wins."""
    argv = list(argv)
    for flag, value in zip(pairs[::2], pairs[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


def _dry_run_sections(out: str) -> dict:
    """``{stage: [options]}`` from a dataflow dry run's ``# STAGE options`` sections."""
    import shlex

    sections, current = {}, None
    for line in out.splitlines():
        match = re.fullmatch(r"# (plan|generate|collect) options \(one a line, shell-quoted\):", line)
        if match:
            current = sections.setdefault(match.group(1), [])
        elif line.startswith("#"):
            current = None
        elif current is not None:
            current.append(shlex.split(line)[0])
    return sections


def test_submissions_default_to_bf16_and_an_explicit_dtype_wins(launcher, kubectl, capsys):
    def planned_dtype(argv):
        code, out, err = cli_main([*argv, "--dry-run"], capsys)
        assert code == 0, err
        return json.loads(out.split("# settings: ", 1)[1].split("\n", 1)[0])["dtype"]

    assert planned_dtype(DATAFLOW) == planned_dtype(GKE) == "bf16"
    assert planned_dtype([*DATAFLOW, "--dtype", "fp32"]) == planned_dtype([*GKE, "--dtype", "fp32"]) == "fp32"
    code, out, err = cli_main([*GKE, "--dry-run"], capsys)
    assert "--dtype bf16" in out  # the plan command the JobSet's hosts will find in run.json
    from jobs import cli

    parser = cli.build_parser()
    for target in ("dataflow", "gke"):
        with pytest.raises(SystemExit):
            parser.parse_args(["submit", target, "--help"])
        assert "(default on TPU: bf16; --dtype fp32 for float32)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--help"])
    assert "(default: fp32)" in capsys.readouterr().out  # local runs keep float32


# ALL_CHANGED's settings as submit flags, written out by hand, after DATAFLOW's or GKE's with
# --steps 7 (dtype: submit's default, bf16); devices_per_host comes from the TPU slice, and the
# fields of gke.NOT_FLAGS from the plan
SUBMIT_ALL_CHANGED = [
    "--model", "gs://b/models/sd", "--unet", "gs://b/unet.safetensors", "--lora", "gs://b/loras/style@0.75",
    "--lora", "gs://b/lcm.safetensors", "--width", "64", "--height", "48", "--sizes", "64x48,48x64",
    "--scheduler", "dpmpp",
    "--timestep-spacing", "trailing", "--guidance-scale", "3.25", "--max-sequence-length", "256", "--seed", "12",
    "--per-device-batch", "3,2", "--device-memory", "15.5", "--batches-per-slice", "3", "--fsdp", "2",
    "--decode-batch", "2", "--attention", "chunked", "--format", "zarr,files", "--image-format", "webp", "--quality", "80",
    "--save-latents", "--prompt-field", "text", "--dedupe", "--score", "safety,clip,aesthetic",
    "--clip-model", "gs://b/clip", "--aesthetic-head", "gs://b/a.safetensors", "--safety-checker", "gs://b/sd",
    "--min-clip-similarity", "0.28", "--min-aesthetic", "5.5", "--drop-nsfw"]


def _printed_settings(out: str) -> dict:
    """The settings a dry run prints: those the flags give (the plan's own decisions are named)."""
    assert "# decided when the run is planned (then in run.json): " + ", ".join(sorted(gke.NOT_FLAGS)) in out
    return json.loads(out.split("# settings: ", 1)[1].split("\n", 1)[0])


def _given(settings: Settings) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.to_dict().items() if k not in gke.NOT_FLAGS}


def _printed(out: str, start: str) -> list[str]:
    """The words of the one dry-run line ``#    START...``."""
    [line] = [line for line in out.splitlines() if line.startswith("#    " + start)]
    return shlex.split(line[len("#    "):])


def test_what_a_gke_dry_run_prints_plans_every_setting_it_checked(kubectl, monkeypatch, capsys):
    """Every setting given to submit gke is in the printed plan command, which the real CLI
    plans as the same settings (the planning itself faked)."""
    from jobs import cli

    argv = [*given(GKE, "--steps", "7"), *SUBMIT_ALL_CHANGED, "--overwrite"]
    code, out, err = cli_main([*argv, "--plan-beam-args", "--runner DirectRunner", "--dry-run"], capsys)
    assert code == 0, err
    checked = _flag_fields(ALL_CHANGED).replace(devices_per_host=4)  # v5e 4x4: 4 hosts of 4 chips
    assert _printed_settings(out) == _given(checked)
    command = _printed(out, "promptmill plan ")
    assert command[-3:] == ["--runner", "DirectRunner", "--overwrite"]
    planned = []
    monkeypatch.setattr("jobs.cli._lease", _no_lease)  # nothing is planned: no OUT is written
    monkeypatch.setattr("pipeline.plan.transforms.run_plan",
                        lambda settings, beam_args, overwrite, cap: planned.append((settings, overwrite)) or {})
    assert cli.main(command[1:]) == 0
    assert planned == [(checked, True)]


def test_what_a_dataflow_dry_run_prints_plans_every_setting_it_checked(monkeypatch, capsys):
    """Every setting given to submit dataflow is in the printed plan job's launcher command,
    which the real launcher reads back as the same settings (the launch itself faked)."""
    from jobs import dataflow_launcher as launcher_cli

    monkeypatch.delenv("DATAFLOW_LAUNCHER", raising=False)
    argv = [*given(DATAFLOW, "--steps", "7"), *SUBMIT_ALL_CHANGED]
    code, out, err = cli_main([*argv, "--dry-run"], capsys)
    assert code == 0, err
    checked = _flag_fields(ALL_CHANGED)  # v5e 2x4 on Dataflow: one host of 8 chips
    assert _printed_settings(out) == _given(checked)
    command = _printed(out, shlex.join(dataflow.launcher_command()) + " run plan ")
    printed_options = _dry_run_sections(out)["plan"]
    launcher = dataflow.launcher_command()
    assert command[:len(launcher) + 2] == [*launcher, "run", "plan"] and \
        command[-len(printed_options) - 1:] == ["--", *printed_options]
    launched = []
    monkeypatch.setattr("pipeline.cloud.dataflow_stages.launch",
                        lambda *a: launched.append(a) or {"job_id": "j", "state": "PENDING"})
    assert launcher_cli.main(command[len(launcher):]) == 0
    [(stage, out_, options, settings, overwrite, cap)] = launched
    assert (stage, out_, options, settings, overwrite, cap) == ("plan", OUT, printed_options, checked, False, None)


@pytest.mark.parametrize("argv,message", [
    (given(DATAFLOW, "--out", "/tmp/promptmill-out"), "--out must be a gs://BUCKET/PREFIX path for submit dataflow"),
    (given(DATAFLOW, "--prompts", "prompts/*.jsonl"), "--prompts must be a gs://BUCKET/PREFIX path"),
    (given(DATAFLOW, "--image", ""), "submit dataflow needs --image, e.g. --image"),
    (given(DATAFLOW, "--project", ""), "submit dataflow needs --project"),
    (given(DATAFLOW, "--tpu-type", "v9"), "unknown --tpu-type 'v9'; supported: v5e, v6e, v5p"),
    (given(DATAFLOW, "--topology", "2by4"), "--topology must be chips per dimension joined by 'x'"),
    (given(DATAFLOW, "--topology", "4x4"), "cannot run on Dataflow: it needs 4 hosts"),
    ([*DATAFLOW, "--machine_type", "ct5lp-hightpu-4t"], "conflicts with what submit dataflow sets"),
    ([*DATAFLOW, "--model", "tests"], "is a folder on this machine"),
    (given(GKE, "--out", "promptmill-out"), "--out must be a gs://BUCKET/PREFIX path for submit gke"),
    (given(GKE, "--image", ""), "submit gke needs --image"),
    (given(GKE, "--tpu-type", "tpu-v9"), "unknown --tpu-type 'tpu-v9'"),
    (given(GKE, "--topology", "4x4x4"), "--tpu-type v5e does not support --topology 4x4x4"),
    (given(GKE, "--topology", "4 x 4"), "--topology must be chips per dimension"),
    ([*GKE, "--machine-type", "ct5lp-hightpu-8t"], "v5e 4x4 does not run on --machine-type ct5lp-hightpu-8t"),
    ([*GKE, "--coordinator-port", "0"], "--coordinator-port must be in [1, 65535]"),
    ([*GKE, "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    ([*GKE, "--poll-seconds", "0"], "--poll-seconds must be > 0"),
    (given(GKE, "--steps", "0"), "--steps must be"),
    ([*GKE, "--plan-beam-args=--runner 'Direct"], "--plan-beam-args must be Beam options in one shell-quoted"),
])
def test_bad_input_is_a_clear_error_and_nothing_is_submitted(argv, message, kubectl, launcher, capsys):
    code, out, err = cli_main(argv, capsys)
    assert code == 1
    assert message in err
    assert kubectl() == [] and launcher() == []


# ---------------------------------------------------------------- what the GKE and Dataflow tests share


def _commit(out, index):
    storage.write_json(naming.shard_stats(out, index), {"slice": index})


def _interrupt(seconds):
    raise KeyboardInterrupt


def _dataflow_job(out, **changes):
    fields = dict(settings=Settings(out=out), tpu_slice=tpu.for_dataflow("v5e", "2x4"), plan_options=("--a=1",),
                  generate_options=("--b=2",), collect_options=("--c=3",), project="p", region="r", poll_s=0.01)
    return dataflow.DataflowJob(**{**fields, **changes})
