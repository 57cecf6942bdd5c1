"""``promptmill submit dataflow|gke``: flags, validation, and the call into ``pipeline.cloud``
(``dataflow`` for Dataflow, ``gke`` for a GKE TPU slice).

jobs/cli.py adds the parser with ``add_submit_parser`` and dispatches to ``run_submit``.
Bad input is a ValueError (the CLI prints it and exits 1) raised before anything is
planned, applied or launched.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from jobs import flags, strict
from pipeline.cloud import checks, dataflow as dataflow_lib, gke as gke_lib, jobset, program_check, submission, tpu
from pipeline.io import lease

SUMMARY = ("images", "records", "rejects", "verified")  # what the other commands print of the dataset stats
TPU_DTYPE = "bf16"  # the submissions' --dtype default: TPU runs compute in bf16
_DATAFLOW_EXAMPLE = ("promptmill submit dataflow --tpu-type v5e --topology 2x4 --image IMAGE --project P "
                     "--region R --prompts gs://B/prompts/*.jsonl --out gs://B/runs/{date} --date 2025-01-31")


def _require(parser: argparse.ArgumentParser, *dests: str) -> None:
    """Drop the local defaults of flags that must be given for a submission (--out, --prompts)."""
    for action in parser._actions:  # argparse has no public way to change an added flag
        if action.dest in dests:
            action.required = True
            action.default = None
            action.help = (action.help or "").split(" (default:")[0] + " (required: gs://BUCKET/PREFIX)"


def _tpu_dtype(parser: argparse.ArgumentParser) -> None:
    """bf16 by default: what TPU runs use (fp32 weights double the HBM and the memory traffic)."""
    parser.set_defaults(dtype=TPU_DTYPE)
    for action in parser._actions:  # argparse has no public way to change an added flag's help
        if action.dest == "dtype":
            action.help = (action.help or "").split(" (default:")[0] + \
                " (default on TPU: %(default)s; --dtype fp32 for float32)"


def _add_common(parser: argparse.ArgumentParser) -> None:
    flags.add_settings_flags(parser)
    _require(parser, "out", "prompts")
    _tpu_dtype(parser)
    flags.add_date_flag(parser)
    parser.add_argument("--tpu-type", help="TPU type: v5e, v6e, v5p or tpu7x (Ironwood: two devices a chip) (or "
                        "tpu-v5-lite-podslice, tpu-v6e-slice, tpu-v5p-slice, ironwood); required")
    parser.add_argument("--topology", help="TPU topology, chips per dimension, e.g. 2x4 or 2x2x1; required")
    parser.add_argument("--image", help="container image with promptmill and the TPU runtime "
                        "(e.g. REGION-docker.pkg.dev/PROJECT/REPO/promptmill:TAG); required")
    flags.add_overwrite_flag(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="print everything that would be run or launched, and run nothing (the TPU check runs)")
    parser.add_argument("--no-tpu-check", action="store_true",
                        help="skip the TPU check: by default the program of one host is compiled here for the "
                             "target TPU chip, from shapes alone (libtpu: pip install \"promptmill[tpu]\"), and a "
                             "program that does not fit is refused before anything launches; --per-device-batch "
                             "auto resolves against the chip the same way")


def add_submit_parser(sub) -> argparse.ArgumentParser:
    """Add ``submit`` with its ``dataflow`` and ``gke`` subcommands to ``sub`` (the CLI's subparsers)."""
    submit = sub.add_parser("submit", help="run the job in production: generate on Dataflow TPU workers, or on a "
                            "GKE TPU slice (JobSet), between a plan and a collect")
    targets = submit.add_subparsers(dest="target", required=True)

    dataflow = targets.add_parser(
        "dataflow", help="three Dataflow jobs: plan on CPU workers, generate on single-host TPU workers, collect on "
                         "CPU workers",
        description="Launch plan and collect as Dataflow jobs on CPU workers (--cpu-machine-type) and generate as a "
                    "Dataflow job on single-host TPU workers, in that order, each once the one before it is done; "
                    "the committed slices are printed while generate runs, and a job that fails stops the chain. "
                    "--dtype defaults to bf16. Flags not listed here are passed on to all three jobs as "
                    "Dataflow/Beam options if Beam knows them (e.g. --worker_zone, --network). DATAFLOW_LAUNCHER "
                    "overrides the launcher (python -m jobs.dataflow_launcher). Example: "
                    + _DATAFLOW_EXAMPLE)
    _add_common(dataflow)
    strict.strict(dataflow, beam=True, out=True)
    dataflow.add_argument("--project", help="Google Cloud project of the Dataflow job; required")
    dataflow.add_argument("--region", help="Dataflow region (one with the TPU type, e.g. us-west4); required")
    dataflow.add_argument("--temp-location", help="gs:// folder for Dataflow's temporary and staged files "
                          "(default: OUT/dataflow/tmp, staging in OUT/dataflow/staging)")
    dataflow.add_argument("--max-workers", type=int, default=1,
                          help="most TPU workers at once for generate (--max_num_workers; default: %(default)s)")
    dataflow.add_argument("--cpu-machine-type", default=dataflow_lib.DEFAULT_CPU_MACHINE_TYPE,
                          help="machine type of the plan and collect jobs' CPU workers (default: %(default)s)")
    dataflow.add_argument("--cpu-max-workers", type=int, default=dataflow_lib.DEFAULT_CPU_MAX_WORKERS,
                          help="most CPU workers at once for plan and collect (default: %(default)s)")
    dataflow.add_argument("--poll-seconds", type=float, default=submission.DEFAULT_POLL_S,
                          help="seconds between state and progress checks while a job runs (default: %(default)s)")
    dataflow.add_argument("--harness-threads", type=int, default=1,
                          help="threads per worker (--number_of_worker_harness_threads): each holds a copy of the "
                               "model on the worker's chips (default: %(default)s)")
    dataflow.add_argument("--disk-size-gb", type=int, default=dataflow_lib.DEFAULT_DISK_SIZE_GB,
                          help="worker boot disk, which holds the container image and the model (default: "
                               "%(default)s)")
    dataflow.add_argument("--job-name", help="Dataflow job name prefix (default: promptmill- and a hash of --out); "
                          "with --date the date is appended; the jobs are NAME-plan, NAME-generate, NAME-collect")

    gke = targets.add_parser(
        "gke", help="plan, generate on a GKE TPU slice (a JobSet, one pod per host), then collect",
        description="Plan (Beam, local unless --plan-beam-args), apply a JobSet that runs `promptmill generate` "
                    "on every host of a TPU slice, follow the committed slices until the JobSet completes, then "
                    "collect. --dtype defaults to bf16. Flags not listed here are Beam options for plan and "
                    "collect. kubectl must point at the cluster (KUBECTL overrides the kubectl on PATH).")
    _add_common(gke)
    gke.add_argument("--machine-type", help="TPU machine type, where a topology runs on two (v5e/v6e 2x4: "
                     "ct5lp-hightpu-8t / ct6e-standard-8t, one host, by default; or ...-4t, two hosts)")
    gke.add_argument("--name", help="JobSet name (default: promptmill- and a hash of --out, so re-running a command "
                     "finds its JobSet); with --date the date is appended")
    gke.add_argument("--namespace", default="default", help="Kubernetes namespace (default: %(default)s)")
    gke.add_argument("--max-restarts", type=int, default=3,
                     help="JobSet restarts after a host fails; restarted hosts resume from the committed slices "
                          "(default: %(default)s)")
    gke.add_argument("--coordinator-port", type=int, default=jobset.DEFAULT_COORDINATOR_PORT,
                     help="jax.distributed coordinator port on host 0 (default: %(default)s)")
    gke.add_argument("--service-account", help="Kubernetes service account of the pods (Workload Identity, for "
                     "access to the gs:// paths)")
    gke.add_argument("--plan-beam-args", help="Beam options for plan, one quoted string, e.g. '--runner "
                     "DataflowRunner --project P --region R --temp_location gs://B/tmp' (default: the flags not "
                     "listed here)")
    gke.add_argument("--collect-beam-args", help="Beam options for collect, one quoted string (default: the flags "
                     "not listed here)")
    gke.add_argument("--poll-seconds", type=float, default=submission.DEFAULT_POLL_S,
                     help="seconds between progress checks while the JobSet runs (default: %(default)s)")
    strict.strict(gke, beam=True, beam_strings=("--plan-beam-args", "--collect-beam-args"), out=True)
    return submit


def _checked(args, job):
    """``job`` (validated, its settings as the flags give them) with its settings checked
    against its TPU slice's chips (``program_check.resolve_submission``: ``--per-device-batch
    auto`` resolved), the ``tpu_program`` report and the plan's ``cap_hosts``. Runs last, once
    every other flag was found good: the check compiles for minutes at real sizes."""
    settings, report, cap = program_check.resolve_submission(job.settings, job.tpu_slice, skip=args.no_tpu_check,
                                                             overwrite=args.overwrite, look=not args.dry_run)
    return dataclasses.replace(job, settings=_as_planned(settings), tpu_program=report, cap_hosts=cap)


def _as_planned(settings):
    """``settings``, once it is sure that the plan reads them back from its flags as they are:
    GKE's plan command and the Dataflow plan job's launcher carry them as ``promptmill plan``'s
    flags (``gke.settings_flags``), and what is planned must be what the TPU check checked. A
    RuntimeError names the settings that would differ (a flag that cannot say a value)."""
    planned = flags.settings_from_flags(gke_lib.settings_flags(settings))
    differ = [f"{f.name} ({getattr(settings, f.name)!r}, planned as {getattr(planned, f.name)!r})"
              for f in dataclasses.fields(settings) if getattr(settings, f.name) != getattr(planned, f.name)]
    if differ:
        raise RuntimeError(f"the plan would not read back the settings the submission checked: {', '.join(differ)}")
    return settings


def _check_common(args, target: str) -> None:
    checks.require_gcs("--out", args.out, target)
    checks.require_gcs("--prompts", args.prompts, target)
    checks.require_remote_model(args.model, target)
    checks.require_value("--image", args.image, target, "REGION-docker.pkg.dev/PROJECT/REPO/promptmill:TAG")
    checks.require_value("--tpu-type", args.tpu_type, target, "v5e")
    checks.require_value("--topology", args.topology, target, "2x4")


def _beam_args(flag: str, value: str | None, default: list[str]) -> list[str]:
    if value is None:
        return list(default)
    try:
        return shlex.split(value)
    except ValueError as e:
        raise ValueError(f"{flag} must be Beam options in one shell-quoted string, got {value!r} ({e})") from None


def _build_dataflow(args, beam_args: list[str]) -> dataflow_lib.DataflowJob:
    _check_common(args, "dataflow")
    checks.require_value("--project", args.project, "dataflow", "my-project")
    checks.require_value("--region", args.region, "dataflow", "us-west4")
    worker = tpu.for_dataflow(args.tpu_type, args.topology)
    settings = flags.settings_from_args(args, worker.chips, tpu_check=True).validate()
    name = checks.job_name(args.out, args.job_name, getattr(args, "date", None))
    if not args.poll_seconds > 0:
        raise ValueError(f"--poll-seconds must be positive, got {args.poll_seconds!r}")
    common = dict(project=args.project, region=args.region, image=args.image, out=args.out,
                  temp_location=args.temp_location, disk_size_gb=args.disk_size_gb, extra=beam_args)
    cpu = dict(common, max_workers=args.cpu_max_workers)
    generate = dataflow_lib.dataflow_options(worker, job=f"{name}-generate", max_workers=args.max_workers,
                                             harness_threads=args.harness_threads, **common)
    return _checked(args, dataflow_lib.DataflowJob(
        settings=settings, tpu_slice=worker, project=args.project, region=args.region,
        plan_options=tuple(dataflow_lib.cpu_options(args.cpu_machine_type, job=f"{name}-plan", **cpu)),
        generate_options=tuple(generate),
        collect_options=tuple(dataflow_lib.cpu_options(args.cpu_machine_type, job=f"{name}-collect", **cpu)),
        cpu_machine_type=args.cpu_machine_type, overwrite=args.overwrite, poll_s=args.poll_seconds))


def _build_gke(args, beam_args: list[str]) -> jobset.GkeJob:
    _check_common(args, "gke")
    chosen = tpu.lookup(args.tpu_type, args.topology, args.machine_type)
    plan_args = _beam_args("--plan-beam-args", args.plan_beam_args, beam_args)
    collect_args = _beam_args("--collect-beam-args", args.collect_beam_args, beam_args)
    settings = flags.settings_from_args(args, chosen.devices_per_host, tpu_check=True).validate()
    return _checked(args, jobset.GkeJob(
        settings=settings, tpu_slice=chosen, name=checks.job_name(args.out, args.name, getattr(args, "date", None)),
        image=args.image, namespace=args.namespace, max_restarts=args.max_restarts,
        coordinator_port=args.coordinator_port, service_account=args.service_account,
        plan_beam_args=tuple(plan_args), collect_beam_args=tuple(collect_args), overwrite=args.overwrite,
        poll_s=args.poll_seconds).validate())


def _progress(target: str):
    return lambda message: print(f"promptmill submit {target}: {message}", file=sys.stderr, flush=True)


def run_submit(args, beam_args: list[str]) -> int:
    """Run ``promptmill submit dataflow|gke`` (the CLI turns a ValueError / RuntimeError into exit 1)."""
    if args.target == "dataflow":
        job = _build_dataflow(args, beam_args)
        if args.dry_run:
            print(dataflow_lib.dataflow_dry_run(job))
            return 0
        # the submit command renews it while it follows the jobs (Dataflow workers do not)
        with lease.Held(job.out, "promptmill submit dataflow", owner=f"dataflow:{job.out}"):
            stats = dataflow_lib.submit_dataflow(job, emit=_progress("dataflow"))
        print(json.dumps({k: stats[k] for k in SUMMARY}))
        return 0
    if args.target == "gke":
        job = _build_gke(args, beam_args)
        if args.dry_run:
            print(gke_lib.gke_dry_run(job), end="")
            return 0
        with lease.Held(job.out, f"promptmill submit gke {job.name}", owner=jobset.lease_owner(job)):
            stats = gke_lib.submit_gke(job, emit=_progress("gke"))
        print(json.dumps({k: stats[k] for k in SUMMARY}))
        return 0
    raise ValueError(f"unknown submit target {args.target!r}; use dataflow or gke")
