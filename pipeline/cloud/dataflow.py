"""``submit dataflow``: three Dataflow jobs in a row: plan on CPU, generate on TPU, collect on CPU workers.

Only generate needs a TPU, so plan (reading and validating the prompts) and collect
(merging metadata, verifying, the gallery) run as their own jobs on CPU machine types,
billed at CPU rates, and the TPU job runs only the beam engine's Generate step
(``pipeline.engines.beam.build_generate``) over the planned slices. Each job is launched
once the one before it is DONE; a job that ends in any other terminal state stops the
chain with its job id and state. While generate runs, the committed slices are counted
(``shards/*_stats.json``), as ``submit gke`` does.

The TPU job's options: a single-host TPU worker per Dataflow worker (``worker_accelerator``),
the machine type Dataflow requires for it, the custom container (Runner v2) and one SDK
process per worker, since a TPU can be opened by one process only. The CPU jobs' options:
the same container and locations, a CPU machine type and no accelerator.

Every launch and every state query goes through one seam, the launcher executable
(``python -m jobs.dataflow_launcher``, whose work ``pipeline.cloud.dataflow_stages`` does, or
``DATAFLOW_LAUNCHER``; the tests use a fake). The plan job gets the run's settings as the flags
``promptmill plan`` takes (``pipeline.cloud.gke.settings_flags``, every setting), which the
launcher reads back with the CLI's own parser, as ``submit gke``'s plan command is read. The
option builders and the dry run are pure: ``--dry-run`` prints exactly what would be launched.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import time
from typing import Callable

from pipeline.cloud import checks, program_check, tpu
from pipeline.cloud.gke import committed_slices, settings_flags, settings_lines
from pipeline.cloud.submission import Submission
from pipeline.core import children, naming
from pipeline.core.numbers import counted
from pipeline.io import storage

# Dataflow's batch default (25 GB with Shuffle) is too small for a JAX/libtpu image and a model.
DEFAULT_DISK_SIZE_GB = 100
# Plan and collect parse JSON and parquet and write thumbnails: general-purpose CPU work.
DEFAULT_CPU_MACHINE_TYPE = "n2-standard-4"
DEFAULT_CPU_MAX_WORKERS = 10

STAGES = ("plan", "generate", "collect")  # launched in this order, each once the one before is DONE
SUCCEEDED = "DONE"
# Beam's other terminal PipelineStates: the job stopped without finishing its work.
STOPPED_STATES = ("FAILED", "CANCELLED", "UPDATED", "DRAINED")
STATE_FAILURES_TOLERATED = 5  # consecutive failed state queries before the wait gives up
LAUNCH_TIMEOUT_S = 900  # submitting a job stages the pipeline; it does not wait for the job
STATE_TIMEOUT_S = 120

# Dataflow options the option builders set, and the `submit dataflow` flag that sets each
# (None: the TPU type and topology decide it).
_TPU_OWNED = {
    "runner": None, "project": "--project", "region": "--region", "temp_location": "--temp-location",
    "staging_location": "--temp-location", "sdk_container_image": "--image", "machine_type": None,
    "worker_machine_type": None, "job_name": "--job-name", "max_num_workers": "--max-workers",
    "number_of_worker_harness_threads": "--harness-threads", "disk_size_gb": "--disk-size-gb",
}
_CPU_OWNED = {
    "runner": None, "project": "--project", "region": "--region", "temp_location": "--temp-location",
    "staging_location": "--temp-location", "sdk_container_image": "--image", "machine_type": "--cpu-machine-type",
    "worker_machine_type": "--cpu-machine-type", "job_name": "--job-name", "max_num_workers": "--cpu-max-workers",
    "disk_size_gb": "--disk-size-gb",
}
_TPU_MACHINE_TYPES = frozenset(s.machine_type for s in tpu.SLICES)


def parse_beam_args(args: list[str]) -> list[tuple[str, str | None]]:
    """``['--a=1', '--b', '2', '--c']`` -> ``[('a', '1'), ('b', '2'), ('c', None)]`` (names with '_')."""
    parsed: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--") or token == "--":
            raise ValueError(f"Beam options must look like --name=value or --name value, got {token!r}")
        name, eq, value = token[2:].partition("=")
        if not eq:
            value = None
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
        parsed.append((name.replace("-", "_"), value))
        i += 1
    return parsed


def _option(name: str, value) -> str:
    return f"--{name}={value}"


def _positive(**values) -> None:
    for flag, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value!r}")


def _locations(out: str, temp_location: str | None) -> tuple[str, str]:
    """(temp, staging): ``OUT/dataflow/tmp`` and ``OUT/dataflow/staging``, or under ``--temp-location``."""
    temp = checks.require_gcs("--temp-location", temp_location or naming.join(out, "dataflow", "tmp"), "dataflow")
    staging = naming.join(out, "dataflow", "staging") if temp_location is None else naming.join(temp, "staging")
    return temp, staging


def _with_extra(owned: list[tuple[str, object]], hints: dict, extra, fixed_why: Callable[[str], str]) -> list[str]:
    """``owned`` as options, then ``extra``; an extra that sets an owned option to another value is an error."""
    values = {name: str(value) for name, value in owned}
    values["worker_machine_type"] = values["machine_type"]
    options = [_option(name, value) for name, value in owned]
    for name, value in parse_beam_args(list(extra)):
        if name in hints:
            if value == values.get(name):
                continue  # the same value twice: keep one
            why = f"set it with {hints[name]}" if hints[name] else fixed_why(values[name])
            raise ValueError(f"--{name}={value} conflicts with what submit dataflow sets ({values.get(name)}); {why}")
        if name in ("dataflow_service_options", "dataflow_service_option") and value and \
                value.startswith("worker_accelerator"):
            raise ValueError(f"--{name}={value}: the worker accelerator comes from --tpu-type and --topology, and "
                             f"only the generate job has one")
        options.append(_option(name, value) if value is not None else f"--{name}")
    return options


def dataflow_options(s: tpu.TpuSlice, *, project: str, region: str, image: str, out: str, job: str,
                     temp_location: str | None = None, max_workers: int = 1, harness_threads: int = 1,
                     disk_size_gb: int = DEFAULT_DISK_SIZE_GB, extra: list[str] | tuple = ()) -> list[str]:
    """The DataflowRunner options of the generate job, on single-host TPU workers ``s``.

    * ``--dataflow_service_options=worker_accelerator=type:T;topology:X`` and the machine
      type Dataflow requires for it (its TPU table; ``pipeline.cloud.tpu``);
    * ``--sdk_container_image`` (the custom container: the TPU runtime and promptmill)
      with ``use_runner_v2`` (custom containers need Runner v2) and
      ``no_use_multiple_sdk_containers``: one SDK process per worker, because a TPU
      can be opened by one process at a time ("Device or resource busy" otherwise);
    * ``--number_of_worker_harness_threads`` (default 1: one DoFn instance drives every
      chip of the worker; more threads would hold more copies of the model);
    * ``--temp_location`` / ``--staging_location``: default ``OUT/dataflow/tmp`` and
      ``OUT/dataflow/staging``, in the run's bucket, next to its outputs;
    * ``--max_num_workers`` (default 1: TPU capacity is scarce; raise it to your quota);
    * ``--disk_size_gb`` (default 100: the boot disk holds the container image and the
      model; Dataflow's batch default of 25 GB with Shuffle is too small for them).
    ``extra`` (flags ``submit`` does not know) are appended; one that sets an option
    above to another value is an error naming the flag to use instead.
    """
    if not s.dataflow:
        raise ValueError(f"{s.describe()} is not a Dataflow worker (Dataflow runs single-host slices only; "
                         f"see pipeline.cloud.tpu.for_dataflow)")
    _positive(max_workers=max_workers, harness_threads=harness_threads, disk_size_gb=disk_size_gb)
    temp, staging = _locations(out, temp_location)
    owned = [
        ("runner", "DataflowRunner"), ("project", project), ("region", region), ("job_name", job),
        ("temp_location", temp), ("staging_location", staging), ("sdk_container_image", image),
        ("machine_type", s.machine_type), ("dataflow_service_options", f"worker_accelerator={tpu.worker_accelerator(s)}"),
        ("experiments", "use_runner_v2"), ("experiments", "no_use_multiple_sdk_containers"),
        ("number_of_worker_harness_threads", harness_threads), ("max_num_workers", max_workers),
        ("disk_size_gb", disk_size_gb),
    ]
    return _with_extra(owned, _TPU_OWNED, extra,
                       lambda required: f"{s.tpu_type} {s.topology} on Dataflow requires {required}")


def cpu_options(machine_type: str = DEFAULT_CPU_MACHINE_TYPE, *, project: str, region: str, image: str, out: str,
                job: str, temp_location: str | None = None, max_workers: int = DEFAULT_CPU_MAX_WORKERS,
                disk_size_gb: int = DEFAULT_DISK_SIZE_GB, extra: list[str] | tuple = ()) -> list[str]:
    """The DataflowRunner options of the plan and collect jobs, on CPU workers.

    The same container, project, region, locations and boot disk as the generate job
    (``dataflow_options``), a CPU ``machine_type`` (a TPU machine type is refused: these
    jobs would hold a TPU they never use), no ``worker_accelerator``, and Dataflow's own
    SDK processes per worker (one per core), since no TPU needs to be held by one.
    ``--max_num_workers`` defaults to 10: the jobs read and write small files.
    """
    if not machine_type or machine_type in _TPU_MACHINE_TYPES:
        raise ValueError(f"--cpu-machine-type must be a CPU machine type (e.g. {DEFAULT_CPU_MACHINE_TYPE}) for the "
                         f"plan and collect jobs, got {machine_type!r}")
    _positive(cpu_max_workers=max_workers, disk_size_gb=disk_size_gb)
    temp, staging = _locations(out, temp_location)
    owned = [
        ("runner", "DataflowRunner"), ("project", project), ("region", region), ("job_name", job),
        ("temp_location", temp), ("staging_location", staging), ("sdk_container_image", image),
        ("machine_type", machine_type), ("experiments", "use_runner_v2"), ("max_num_workers", max_workers),
        ("disk_size_gb", disk_size_gb),
    ]
    return _with_extra(owned, _CPU_OWNED, extra, lambda required: f"it is {required}")


def format_options(options: list[str] | tuple) -> str:
    """One option a line, each quoted for a POSIX shell."""
    return "\n".join(shlex.quote(option) for option in options)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataflowJob(Submission):
    """Three Dataflow jobs: plan and collect on CPU workers, generate on TPU workers (the
    ``tpu_slice``, single-host); their DataflowRunner options, stage by stage."""
    plan_options: tuple[str, ...]
    generate_options: tuple[str, ...]
    collect_options: tuple[str, ...]
    project: str
    region: str
    cpu_machine_type: str = DEFAULT_CPU_MACHINE_TYPE

    def options(self, stage: str) -> tuple[str, ...]:
        return {"plan": self.plan_options, "generate": self.generate_options, "collect": self.collect_options}[stage]

    def workers(self, stage: str) -> str:
        if stage == "generate":
            return f"TPU workers ({self.tpu_slice.describe()})"
        return f"CPU workers ({self.cpu_machine_type})"


def launcher_command() -> list[str]:
    """``DATAFLOW_LAUNCHER`` (an executable), or this Python running the launcher's command line,
    ``jobs.dataflow_launcher`` (it reads the plan's settings flags with the CLI's parser; the work is
    ``pipeline.cloud.dataflow_stages``'s)."""
    override = os.environ.get("DATAFLOW_LAUNCHER")
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise RuntimeError(f"DATAFLOW_LAUNCHER={override!r} is not an executable file")
        return [override]
    return children.python("-m", "jobs.dataflow_launcher")


def stage_arguments(job: DataflowJob, stage: str) -> list[str]:
    """The launcher's arguments that submit ``stage`` (``jobs.dataflow_launcher``); the plan's
    carry every setting as ``promptmill plan``'s flags (``settings_flags``, with ``--out``)."""
    if stage != "plan":
        return ["run", stage, "--out", job.out, "--", *job.options(stage)]
    arguments = ["run", stage, *settings_flags(job.settings)]
    if job.overwrite:
        arguments.append("--overwrite")
    if job.cap_hosts is not None:
        arguments += ["--cap-hosts", str(job.cap_hosts)]
    return [*arguments, "--", *job.options(stage)]


class Launcher:
    """Runs the launcher executable; a failed call or an answer without a job id and state is a RuntimeError."""

    def __init__(self, command: list[str] | None = None):
        self.command = list(command or launcher_command())

    def _call(self, arguments: list[str], timeout: float) -> dict:
        shown = shlex.join([*self.command, *arguments[:2]]) + " ..."
        try:
            done = subprocess.run([*self.command, *arguments], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`{shown}` did not finish in {timeout:g} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"`{shown}` failed (exit code {done.returncode}): {done.stderr.strip()[-2000:]}")
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        try:
            answer = json.loads(lines[-1])
            return {"job_id": str(answer["job_id"]), "state": str(answer["state"]),
                    "plan_kept": bool(answer.get("plan_kept"))}
        except (IndexError, ValueError, KeyError, TypeError):
            raise RuntimeError(f"`{shown}` answered {done.stdout.strip()[-500:]!r}, not a JSON line with job_id "
                               f"and state") from None

    def launch(self, job: DataflowJob, stage: str) -> tuple[str, str]:
        """Submit ``stage``; (job id, state) once Dataflow accepted it. A plan the run keeps
        (``dataflow_stages.launch``) submits nothing: its job id is ""."""
        answer = self._call(stage_arguments(job, stage), LAUNCH_TIMEOUT_S)
        return ("" if answer["plan_kept"] else answer["job_id"]), answer["state"]

    def state(self, job_id: str, options: tuple[str, ...] | list[str]) -> str:
        return self._call(["state", job_id, "--", *options], STATE_TIMEOUT_S)["state"]


def dataflow_dry_run(job: DataflowJob) -> str:
    """What ``submit dataflow --dry-run`` prints: the settings, then each job's launch and options, in order."""
    launcher = shlex.join(launcher_command())
    lines = [
        "# promptmill submit dataflow --dry-run: nothing was launched. It would launch three Dataflow jobs, in order, "
        "each once the one before it is DONE:",
        "# " + program_check.summary(job.tpu_program),
        *settings_lines(job.settings),
    ]
    for number, stage in enumerate(STAGES, 1):  # each command whole, as it would run: paste it without the "#"
        lines += [
            f"# {number}. {stage} on {job.workers(stage)}:",
            f"#    {launcher} {shlex.join(stage_arguments(job, stage))}",
            f"# {stage} options (one a line, shell-quoted):",
            format_options(job.options(stage)),
        ]
    lines.append(f"# between launches: every {job.poll_s:g} s `{launcher} state JOB_ID -- STAGE_OPTIONS` (the "
                 f"stage's options above) until DONE "
                 f"({', '.join(STOPPED_STATES)} stop the chain); while generate runs, count "
                 f"{naming.join(job.out, 'shards', '*_stats.json')} (committed slices)")
    return "\n".join(lines)


class StageFailed(RuntimeError):
    """A Dataflow job of the chain ended in a state other than DONE."""


def wait_for_stage(launcher: Launcher, job: DataflowJob, stage: str, job_id: str, state: str,
                   emit: Callable[[str], None], *, total: int | None = None,
                   sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll ``job_id`` until it is DONE; with ``total`` (generate), print ``committed/total`` as it changes.

    A job that ends in another terminal state is a StageFailed with its id and state; a
    generate job DONE with slices missing is one too; so are ``STATE_FAILURES_TOLERATED``
    failed state queries in a row.
    """
    last_done = last_state = None
    failures = 0
    later = STAGES[STAGES.index(stage) + 1:]
    not_launched = f"; the {' and '.join(later)} job(s) were not launched" if later else ""
    hint = (f"see `gcloud dataflow jobs describe {job_id} --project {job.project} --region {job.region}`; committed "
            f"slices are kept: re-running the same command resumes")
    while True:
        if total is not None:
            done = committed_slices(job.out, total)
            if done != last_done:
                emit(f"{done}/{total} slices committed")
                last_done = done
        if state != last_state:
            emit(f"{stage} job {job_id}: {state}")
            last_state = state
        if state == SUCCEEDED:
            if total is not None and last_done < total:
                raise StageFailed(f"Dataflow {stage} job {job_id} is {state} but only {last_done}/{total} slices are "
                                  f"committed in {job.out}{not_launched}; {hint}")
            return
        if state in STOPPED_STATES:
            slices = f" with {last_done}/{total} slices committed" if total is not None else ""
            raise StageFailed(f"Dataflow {stage} job {job_id} ended in state {state}{slices}{not_launched}; {hint}")
        sleep(job.poll_s)
        try:
            state = launcher.state(job_id, job.options(stage))
            failures = 0
        except RuntimeError as e:
            failures += 1
            if failures >= STATE_FAILURES_TOLERATED:
                raise StageFailed(f"could not read the state of Dataflow {stage} job {job_id} {failures} times in a "
                                  f"row: {e}") from e


def stopped_following(job: DataflowJob, stage: str, job_id: str | None) -> str:
    """What ``submit dataflow`` says when Ctrl-C or SIGTERM stops it: the Dataflow job is
    left running, never cancelled silently, and this is how to cancel it."""
    where = f"--project {job.project} --region {job.region}"
    later = STAGES[STAGES.index(stage) + 1:]
    not_launched = f"; the {' and '.join(later)} job(s) will not be launched" if later else ""
    if job_id is None:
        return (f"stopped while launching the Dataflow {stage} job{not_launched}; it may have been submitted: see "
                f"`gcloud dataflow jobs list {where} --status active`, and cancel it with `gcloud dataflow jobs "
                f"cancel JOB_ID {where}`")
    return (f"stopped following Dataflow {stage} job {job_id}; it keeps running{not_launched}. Watch it: "
            f"`promptmill status {job.out}`; cancel it: `gcloud dataflow jobs cancel {job_id} {where}` (or let it "
            f"finish its work in progress: `gcloud dataflow jobs drain {job_id} {where}`); the same submit command "
            f"later resumes from the committed slices")


def submit_dataflow(job: DataflowJob, emit: Callable[[str], None] = print, launcher: Launcher | None = None,
                    sleep: Callable[[float], None] = time.sleep) -> dict:
    """plan (CPU) -> generate (TPU) -> collect (CPU) on Dataflow, each waited on; returns the dataset stats."""
    from pipeline.collect import transforms as collect  # lazily: Beam is not needed to print a dry run

    launcher = launcher or Launcher()  # a bad DATAFLOW_LAUNCHER fails here, before anything is launched
    total = None
    for stage in STAGES:
        job_id = None
        try:
            job_id, state = launcher.launch(job, stage)
            if not job_id:  # a resumed run whose plan is finished: no job was submitted
                emit(f"plan kept: {job.out} holds this run's finished plan, and its inputs are unchanged")
            else:
                emit(f"{stage} job {job_id} launched on {job.workers(stage)}")
                wait_for_stage(launcher, job, stage, job_id, state, emit,
                               total=total if stage == "generate" else None, sleep=sleep)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (pipeline.core.interrupts)
            emit(stopped_following(job, stage, job_id))
            raise
        if stage == "plan":
            manifest = storage.read_json(naming.manifest(job.out))
            total = manifest["slices"]
            emit(f"planned {counted(manifest['records'], 'record')}, {counted(manifest['images'], 'image')} in "
                 f"{counted(total, 'slice')}")
            # a plan that made the run guided runs a larger program than the one checked
            program_check.check_planned(job.out, job.settings if job.tpu_program else None,
                                        job.tpu_slice)
    stats = storage.read_json(naming.dataset_file(job.out, "stats.json"))
    collect.check_verified(stats)
    return stats
