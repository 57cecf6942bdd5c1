"""promptmill submit dataflow: the Dataflow options for every supported slice, conflicts, the
dry run, the wait for a stage, and the three jobs (plan and collect on CPU, generate on TPU)
against a fake launcher, then the real launcher's side of the seam."""
import json
import os
import re
import shlex

import pytest

from pipeline.cloud import checks, dataflow, tpu
from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage
from tests.cloud.conftest import DONE_SCRIPT
from tests.cloud.test_submit import (DATAFLOW, IMAGE, OUT, PROMPTS, _commit, _dataflow_job, _dry_run_sections,
                                     _interrupt, _printed, cli_main, given)


# ---------------------------------------------------------------- every Dataflow TPU slice: options


def _value(options, name):
    return [o.split("=", 1)[1] for o in options if o.startswith(f"--{name}=")]


@pytest.mark.parametrize("s", [s for s in tpu.SLICES if s.dataflow], ids=lambda s: f"{s.tpu_type}-{s.topology}")
def test_dataflow_options_for_every_dataflow_slice(s):
    options = dataflow.dataflow_options(s, project="p", region="us-west4", image=IMAGE, out=OUT, job="pm-x",
                                      extra=["--worker_zone", "us-west4-a"])
    assert _value(options, "dataflow_service_options") == \
        [f"worker_accelerator=type:{s.accelerator};topology:{s.topology}"]
    assert _value(options, "machine_type") == [s.machine_type]
    assert _value(options, "runner") == ["DataflowRunner"]
    assert _value(options, "sdk_container_image") == [IMAGE]
    assert _value(options, "experiments") == ["use_runner_v2", "no_use_multiple_sdk_containers"]
    assert _value(options, "temp_location") == [f"{OUT}/dataflow/tmp"]
    assert _value(options, "number_of_worker_harness_threads") == ["1"]
    assert _value(options, "max_num_workers") == ["1"]
    assert (_value(options, "project"), _value(options, "region")) == (["p"], ["us-west4"])
    assert options[-1] == "--worker_zone=us-west4-a"  # flags submit does not know pass through


@pytest.mark.parametrize("tpu_type,topology", sorted({(s.tpu_type, s.topology) for s in tpu.SLICES}
                                                     - {(s.tpu_type, s.topology) for s in tpu.SLICES if s.dataflow}))
def test_dataflow_refuses_every_other_topology(tpu_type, topology):
    with pytest.raises(ValueError, match=f"--tpu-type {tpu_type} --topology {topology} cannot run on Dataflow"):
        tpu.for_dataflow(tpu_type, topology)


def test_dataflow_option_conflicts():
    s = tpu.for_dataflow("v5e", "2x4")
    kw = dict(project="p", region="r", image=IMAGE, out=OUT, job="pm-x")
    with pytest.raises(ValueError) as e:
        dataflow.dataflow_options(s, **kw, extra=["--machine_type=ct5lp-hightpu-4t"])
    assert "--machine_type=ct5lp-hightpu-4t conflicts" in str(e.value)
    assert "v5e 2x4 on Dataflow requires ct5lp-hightpu-8t" in str(e.value)
    with pytest.raises(ValueError, match="set it with --temp-location"):
        dataflow.dataflow_options(s, **kw, extra=["--temp_location", "gs://other/tmp"])
    with pytest.raises(ValueError, match="the worker accelerator comes from --tpu-type and --topology"):
        dataflow.dataflow_options(s, **kw, extra=["--dataflow_service_options=worker_accelerator=type:x"])
    same = dataflow.dataflow_options(s, **kw, extra=["--worker_machine_type=ct5lp-hightpu-8t", "--save_main_session"])
    assert same == dataflow.dataflow_options(s, **kw) + ["--save_main_session"]
    custom = dataflow.dataflow_options(s, **kw, temp_location="gs://t/tmp", max_workers=8, harness_threads=2)
    assert (_value(custom, "temp_location"), _value(custom, "staging_location")) == (["gs://t/tmp"],
                                                                                      ["gs://t/tmp/staging"])
    assert (_value(custom, "max_num_workers"), _value(custom, "number_of_worker_harness_threads")) == (["8"], ["2"])
    with pytest.raises(ValueError, match="--max-workers must be a positive integer, got 0"):
        dataflow.dataflow_options(s, **kw, max_workers=0)
    with pytest.raises(ValueError, match="Beam options must look like --name=value or --name value, got 'stray'"):
        dataflow.dataflow_options(s, **kw, extra=["stray"])
    with pytest.raises(ValueError, match="--temp-location must be a gs://"):
        dataflow.dataflow_options(s, **kw, temp_location="/tmp/x")


# ---------------------------------------------------------------- the CLI


def test_dataflow_dry_run_prints_three_jobs_plan_and_collect_on_cpu_and_launches_nothing(launcher, capsys):
    code, out, err = cli_main([*DATAFLOW, "--worker_zone", "us-west4-a", "--cpu-machine-type", "n2-highmem-8",
                               "--dry-run"], capsys)
    assert code == 0, err
    assert launcher() == []
    s = tpu.for_dataflow("v5e", "2x4")
    name = checks.job_name(OUT)
    kw = dict(project="p", region="us-west4", image=IMAGE, out=OUT, extra=["--worker_zone", "us-west4-a"])
    sections = _dry_run_sections(out)
    assert list(sections) == ["plan", "generate", "collect"]  # in launch order
    assert sections["generate"] == dataflow.dataflow_options(s, job=f"{name}-generate", **kw)
    assert sections["plan"] == dataflow.cpu_options("n2-highmem-8", job=f"{name}-plan", **kw)
    assert sections["collect"] == dataflow.cpu_options("n2-highmem-8", job=f"{name}-collect", **kw)
    for stage in ("plan", "collect"):
        options = sections[stage]
        assert _value(options, "machine_type") == ["n2-highmem-8"] and _value(options, "max_num_workers") == ["10"]
        assert not any("worker_accelerator" in o or "harness_threads" in o for o in options), options
        assert "--experiments=no_use_multiple_sdk_containers" not in options
        assert _value(options, "sdk_container_image") == [IMAGE] and options[-1] == "--worker_zone=us-west4-a"
    assert _value(sections["generate"], "dataflow_service_options") == \
        ["worker_accelerator=type:tpu-v5-lite-podslice;topology:2x4"]
    assert _value(sections["generate"], "machine_type") == ["ct5lp-hightpu-8t"]
    lines = out.splitlines()
    assert [line.split(" on ")[0] for line in lines if re.match(r"# \d\. ", line)] == \
        ["# 1. plan", "# 2. generate", "# 3. collect"]
    assert "# 2. generate on TPU workers (v5e 2x4" in out and "# 3. collect on CPU workers (n2-highmem-8):" in out
    assert f"run plan --prompts '{PROMPTS}' --out {OUT} --model tiny --steps 4 " in out
    collect = _printed(out, shlex.join(dataflow.launcher_command()) + " run collect ")
    assert "--devices-per-host 8 --fsdp 1 --dtype bf16 " in out and " OPTIONS" not in out  # no placeholder
    assert collect[collect.index("--") + 1:] == sections["collect"]  # the command carries its real options
    settings = json.loads(out.split("# settings: ", 1)[1].split("\n", 1)[0])
    assert (settings["devices_per_host"], settings["steps"], settings["out"], settings["dtype"]) == (8, 4, OUT, "bf16")


def test_cpu_options_refuse_a_tpu_machine_type_and_owned_options():
    kw = dict(project="p", region="r", image=IMAGE, out=OUT, job="pm-x-plan")
    with pytest.raises(ValueError, match="--cpu-machine-type must be a CPU machine type"):
        dataflow.cpu_options("ct5lp-hightpu-8t", **kw)
    with pytest.raises(ValueError, match="set it with --cpu-max-workers"):
        dataflow.cpu_options(**kw, extra=["--max_num_workers=50"])
    with pytest.raises(ValueError, match="only the generate job has one"):
        dataflow.cpu_options(**kw, extra=["--dataflow_service_options=worker_accelerator=type:x"])
    with pytest.raises(ValueError, match="--cpu-max-workers must be a positive integer, got 0"):
        dataflow.cpu_options(**kw, max_workers=0)
    assert dataflow.cpu_options(**kw, extra=["--machine_type=n2-standard-4", "--network=n"]) == \
        dataflow.cpu_options(**kw) + ["--network=n"]


class ScriptedLauncher:
    """Answers state queries from a script (an exception is raised); records them."""

    def __init__(self, states):
        self.states = list(states)
        self.queries = []

    def state(self, job_id, options):
        self.queries.append(job_id)
        state = self.states.pop(0)
        if isinstance(state, Exception):
            raise state
        return state


def test_wait_for_a_dataflow_stage(tmp_path):
    out = str(tmp_path / "out")
    job = _dataflow_job(out)
    commits = iter([0, 1])
    messages = []
    scripted = ScriptedLauncher(["RUNNING", RuntimeError("503"), "RUNNING", "DONE"])
    dataflow.wait_for_stage(scripted, job, "generate", "j-1", "PENDING", messages.append, total=2,
                            sleep=lambda s: _commit(out, next(commits, 1)))
    assert messages == ["0/2 slices committed", "generate job j-1: PENDING", "1/2 slices committed",
                        "generate job j-1: RUNNING", "2/2 slices committed", "generate job j-1: DONE"]
    assert scripted.queries == ["j-1"] * 4
    with pytest.raises(dataflow.StageFailed, match="Dataflow generate job j-2 is DONE but only 2/3 slices are "
                                                   "committed .*; the collect job.s. were not launched"):
        dataflow.wait_for_stage(ScriptedLauncher([]), job, "generate", "j-2", "DONE", lambda m: None, total=3)
    with pytest.raises(dataflow.StageFailed, match="Dataflow plan job j-3 ended in state CANCELLED; the generate "
                                                   "and collect job.s. were not launched; see `gcloud dataflow jobs "
                                                   "describe j-3 --project p --region r`"):
        dataflow.wait_for_stage(ScriptedLauncher(["CANCELLED"]), job, "plan", "j-3", "RUNNING", lambda m: None,
                                sleep=lambda s: None)
    errors = [RuntimeError("timeout")] * dataflow.STATE_FAILURES_TOLERATED
    with pytest.raises(dataflow.StageFailed, match="could not read the state of Dataflow collect job j-4 5 times"):
        dataflow.wait_for_stage(ScriptedLauncher(errors), job, "collect", "j-4", "RUNNING", lambda m: None,
                                sleep=lambda s: None)


# ---------------------------------------------------------------- three Dataflow jobs against a fake launcher


def _dataflow_e2e_args(out):
    return [*given(DATAFLOW, "--out", out), "--job-name", "pm-df", "--poll-seconds", "0.01"]


def _launched_options(calls):
    """{stage: the options of its `run` call}, in launch order."""
    return {c[1]: c[c.index("--") + 1:] for c in calls if c[0] == "run"}


def test_dataflow_launches_plan_generate_collect_in_order_on_cpu_tpu_cpu(gcs_emulator, launcher, capsys):
    out = f"gs://{gcs_emulator}/dataflow-e2e/out"
    code, stdout, err = cli_main(_dataflow_e2e_args(out), capsys)
    assert code == 0, err
    assert json.loads(stdout) == {"images": 4, "records": 4, "rejects": 0, "verified": True}
    calls = launcher()
    # each job is launched once the one before it is DONE, and polled until then
    assert [c[:2] for c in calls] == [
        ["run", "plan"], ["state", "2026-fake-plan"], ["state", "2026-fake-plan"],
        ["run", "generate"], ["state", "2026-fake-generate"], ["state", "2026-fake-generate"],
        ["state", "2026-fake-generate"],
        ["run", "collect"], ["state", "2026-fake-collect"]]
    options = _launched_options(calls)
    assert list(options) == ["plan", "generate", "collect"]
    for stage in ("plan", "collect"):
        assert _value(options[stage], "machine_type") == ["n2-standard-4"], options[stage]
        assert not any("worker_accelerator" in o for o in options[stage])
        assert _value(options[stage], "job_name") == [f"pm-df-{stage}"]
    assert _value(options["generate"], "dataflow_service_options") == \
        ["worker_accelerator=type:tpu-v5-lite-podslice;topology:2x4"]
    assert _value(options["generate"], "machine_type") == ["ct5lp-hightpu-8t"]
    assert _value(options["generate"], "job_name") == ["pm-df-generate"]
    # a state query carries its job's options (project, region)
    for call in calls:
        if call[0] == "state":
            assert call[2:] == ["--", *options[call[1].rsplit("-", 1)[1]]]
    plan_call = calls[0]
    from jobs import dataflow_launcher as launcher_cli

    settings = launcher_cli.plan_settings(launcher_cli.parse(plan_call)[0])  # as the real launcher reads them
    assert (settings.out, settings.dtype, settings.devices_per_host) == (out, "bf16", 8)
    assert "--overwrite" not in plan_call
    progress = [line.split("promptmill submit dataflow: ", 1)[1] for line in err.splitlines()
                if line.startswith("promptmill submit dataflow: ")]
    assert progress[0] == "plan job 2026-fake-plan launched on CPU workers (n2-standard-4)"
    assert "generate job 2026-fake-generate launched on TPU workers (v5e 2x4" in err
    slices = [line for line in progress if line.endswith("slices committed")]
    assert slices == ["0/2 slices committed", "1/2 slices committed", "2/2 slices committed"]
    assert progress.index("planned 4 records, 4 images in 2 slices") < progress.index("0/2 slices committed")
    assert progress[-1] == "collect job 2026-fake-collect: DONE"


@pytest.mark.parametrize("stage,message", [
    ("plan", "Dataflow plan job 2026-fake-plan ended in state FAILED; the generate and collect job(s) were not "
             "launched; see `gcloud dataflow jobs describe 2026-fake-plan --project p --region us-west4`"),
    ("generate", "Dataflow generate job 2026-fake-generate ended in state FAILED with 1/2 slices committed; the "
                 "collect job(s) were not launched"),
    ("collect", "Dataflow collect job 2026-fake-collect ended in state CANCELLED;"),
])
def test_a_dataflow_job_that_fails_stops_the_chain_with_its_id_and_state(stage, message, gcs_emulator, launcher,
                                                                        monkeypatch, capsys):
    script = {**DONE_SCRIPT, stage: ["RUNNING", "RUNNING", "CANCELLED" if stage == "collect" else "FAILED"]}
    monkeypatch.setenv("FAKE_DATAFLOW_SCRIPT", json.dumps(script))
    out = f"gs://{gcs_emulator}/dataflow-e2e/failed-{stage}"
    code, stdout, err = cli_main(_dataflow_e2e_args(out), capsys)
    assert code == 1 and stdout == ""
    assert message in " ".join(err.split()), err
    launched = list(_launched_options(launcher()))
    assert launched == list(dataflow.STAGES[:dataflow.STAGES.index(stage) + 1])
    assert launcher()[-1][:2] == ["state", f"2026-fake-{stage}"]  # nothing after the failed job's last state


def test_a_dataflow_resume_that_keeps_its_plan_launches_no_plan_job(gcs_emulator, launcher, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_DATAFLOW_PLAN_KEPT", "1")
    out = f"gs://{gcs_emulator}/dataflow-e2e/kept"
    code, stdout, err = cli_main(_dataflow_e2e_args(out), capsys)
    assert code == 0, err
    assert [c[:2] for c in launcher()][:2] == [["run", "plan"], ["run", "generate"]]  # no plan job is followed
    assert f"plan kept: {out} holds this run's finished plan, and its inputs are unchanged" in err
    assert "planned 4 records, 4 images in 2 slices" in err


def test_the_launchers_plan_stage_keeps_a_finished_plan_and_submits_nothing(tmp_path, model_cache):
    import apache_beam as beam

    from pipeline.cloud import dataflow_stages
    from pipeline.plan import transforms as plan

    (tmp_path / "p.jsonl").write_text('{"prompt": "a fox"}\n')
    settings = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "out"))
    manifest = plan.run_plan(settings)
    p = beam.Pipeline()
    assert dataflow_stages.build_stage(p, "plan", settings.out, settings) == manifest
    assert "Plan" not in p.applied_labels
    assert dataflow_stages.launch("plan", settings.out, [], settings) == {"job_id": "", "state": "DONE",
                                                                          "plan_kept": True}
    p = beam.Pipeline()
    assert dataflow_stages.build_stage(p, "plan", settings.out, settings, overwrite=True) is None
    assert "Plan" in p.applied_labels  # a new plan (built here, never run)


def test_a_launcher_that_fails_is_a_clear_error(gcs_emulator, launcher, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_DATAFLOW_BROKEN", "1")
    out = f"gs://{gcs_emulator}/dataflow-e2e/broken"
    code, stdout, err = cli_main(_dataflow_e2e_args(out), capsys)
    assert code == 1
    assert f"{os.environ['DATAFLOW_LAUNCHER']} run plan ...` failed (exit code 3): fake launcher: no credentials" in err
    assert [c[:2] for c in launcher()] == [["run", "plan"]]
    monkeypatch.setenv("DATAFLOW_LAUNCHER", "/nonexistent/launcher")
    code, stdout, err = cli_main(_dataflow_e2e_args(out), capsys)
    assert code == 1 and "DATAFLOW_LAUNCHER='/nonexistent/launcher' is not an executable file" in err


def test_the_launcher_reads_what_submit_passes_and_builds_each_stage(tmp_path):
    """The real launcher's side of the seam: its parser takes ``stage_arguments`` as they are, and
    the generate and collect stages build their pipelines over a planned OUT (built, never run)."""
    import apache_beam as beam

    from jobs import dataflow_launcher as launcher_cli
    from pipeline.cloud import dataflow_stages
    from pipeline.core.settings import Run
    from pipeline.io import runs

    out = str(tmp_path / "out")
    job = _dataflow_job(out, settings=Settings(out=out, dtype="bf16", steps=3), overwrite=True)
    assert dataflow.launcher_command()[1:] == ["-P", "-m", "jobs.dataflow_launcher"]  # never the folder it stands in
    for stage in dataflow.STAGES:
        args, options = launcher_cli.parse(dataflow.stage_arguments(job, stage))
        assert (args.command, args.stage, args.out, options) == ("run", stage, out, list(job.options(stage)))
        assert getattr(args, "overwrite", False) == (stage == "plan")
        if stage == "plan":
            assert launcher_cli.plan_settings(args) == job.settings
    args, options = launcher_cli.parse(["state", "j-1", "--", "--project=p", "--region=r"])
    assert (args.command, args.job_id, options) == ("state", "j-1", ["--project=p", "--region=r"])
    with pytest.raises(SystemExit):  # the generate and collect jobs take no settings: they read run.json
        launcher_cli.parse(["run", "generate", "--out", out, "--steps", "3", "--"])
    with pytest.raises(ValueError, match="needs its settings"):
        dataflow_stages.build_stage(beam.Pipeline(), "plan", out)
    with pytest.raises(runs.RunNotPlanned):
        dataflow_stages.build_stage(beam.Pipeline(), "generate", out)
    runs.write(out, Run.create(job.settings, "f" * 64, "2026-01-01T00:00:00+00:00", {}))
    storage.write_json(naming.manifest(out), {"records": 5, "images": 5, "rejects": 0, "slices": 3, "slice_size": 2})
    for stage, label in (("generate", "Generate"), ("collect", "Collect")):
        p = beam.Pipeline()
        dataflow_stages.build_stage(p, stage, out)
        assert label in p.applied_labels and "Plan" not in p.applied_labels


class _Launches:
    """A Dataflow launcher whose launch answers at once, or is interrupted."""

    def __init__(self, interrupted_launch=False):
        self.interrupted_launch = interrupted_launch
        self.launched = []

    def launch(self, job, stage):
        if self.interrupted_launch:
            raise KeyboardInterrupt
        self.launched.append(stage)
        return "2026-11-20_01-j7", "JOB_STATE_RUNNING"

    def state(self, job_id, options):
        return "JOB_STATE_RUNNING"


# ---------------------------------------------------------------- stopped while following


def test_ctrl_c_while_following_a_dataflow_job_leaves_it_running_and_says_how_to_cancel_it(tmp_path):
    job = _dataflow_job(str(tmp_path / "out"))
    messages, launcher = [], _Launches()
    with pytest.raises(KeyboardInterrupt):
        dataflow.submit_dataflow(job, messages.append, launcher=launcher, sleep=_interrupt)
    assert launcher.launched == ["plan"]  # and nothing else: no cancel, no later job
    assert messages[-1].startswith("stopped following Dataflow plan job 2026-11-20_01-j7; it keeps running; "
                                   "the generate and collect job(s) will not be launched")
    assert "`gcloud dataflow jobs cancel 2026-11-20_01-j7 --project p --region r`" in messages[-1]
    messages = []
    with pytest.raises(KeyboardInterrupt):
        dataflow.submit_dataflow(job, messages.append, launcher=_Launches(interrupted_launch=True))
    assert messages == [dataflow.stopped_following(job, "plan", None)]
    assert "it may have been submitted: see `gcloud dataflow jobs list --project p --region r --status active`" \
        in messages[0]
