"""The Dataflow launcher: starts one stage of ``submit dataflow`` as a Dataflow job, or reads a job's state.

``submit dataflow`` runs this as a subprocess, the one place it talks to Dataflow (as
``pipeline.cloud.kubectl`` is for ``submit gke``), and ``DATAFLOW_LAUNCHER`` replaces it
with another executable (the tests point it at a fake). Each call prints one JSON line,
``{"job_id": ..., "state": ...}``, where the state is one of Beam's ``PipelineState`` names
(``RUNNING``, ``DONE``, ``FAILED``, ...), and exits 0; a failure exits non-zero with the
reason on stderr.

    python -m pipeline.cloud.dataflow_launch run plan --out OUT --settings JSON [--overwrite] [--cap-hosts N] -- OPTION...
    python -m pipeline.cloud.dataflow_launch run generate --out OUT -- OPTION...
    python -m pipeline.cloud.dataflow_launch run collect --out OUT -- OPTION...
    python -m pipeline.cloud.dataflow_launch state JOB_ID -- OPTION...

``run`` builds the stage's pipeline and submits it with the DataflowRunner OPTIONs, and
returns once Dataflow has accepted it (it does not wait for the job):

  plan      ``prepare`` (run.json) here, then ``pipeline.plan.transforms.Plan``, as ``promptmill plan``
  generate  ``pipeline.engines.beam.build_generate`` over the planned slices (manifest.json)
  collect   ``pipeline.collect.transforms.Collect``, as ``promptmill collect``
"""
from __future__ import annotations

import argparse
import json
import sys

STAGES = ("plan", "generate", "collect")


def build_stage(p, stage: str, out: str, settings_json: str | None = None, overwrite: bool = False,
                cap_hosts: int | None = None) -> None:
    """Put ``stage``'s transforms for ``out`` on the pipeline ``p``; ``cap_hosts``: see
    ``pipeline.plan.transforms.Plan`` (plan only)."""
    import apache_beam as beam

    from pipeline.core import naming
    from pipeline.io import beamio, runs, storage

    beamio.require_filesystem(out)
    if stage == "plan":
        from pipeline.core.settings import Settings
        from pipeline.plan import transforms as plan
        from pipeline.plan.prepare import prepare

        if settings_json is None:
            raise ValueError("run plan needs --settings")
        settings, _ = prepare(Settings.from_dict(json.loads(settings_json)), overwrite)
        _ = p | "Plan" >> plan.Plan(settings, cap_hosts)
        return
    runs.read(out)  # a clear error when nothing was planned in OUT
    manifest = storage.read_json(naming.manifest(out))
    if stage == "generate":
        from pipeline.engines import beam as beam_engine

        beam_engine.build_generate(p, out, manifest["slices"])
        return
    if stage == "collect":
        from pipeline.collect import transforms as collect

        _ = (p
             | "Manifest" >> beam.Create([manifest])
             | "Collect" >> collect.Collect(out, runs.read(out)))
        return
    raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")


def launch(stage: str, out: str, options: list[str], settings_json: str | None = None,
           overwrite: bool = False, cap_hosts: int | None = None) -> dict:
    """Submit ``stage`` as a Dataflow job; ``{"job_id", "state"}`` once Dataflow accepted it."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    p = beam.Pipeline(options=PipelineOptions(options))
    build_stage(p, stage, out, settings_json, overwrite, cap_hosts)
    result = p.run()  # the DataflowRunner returns once the job is created, without waiting for it
    return {"job_id": result.job_id(), "state": str(result.state)}


def job_state(job_id: str, options: list[str]) -> dict:
    """``{"job_id", "state"}`` of a Dataflow job, read from the Dataflow API (project and region from ``options``)."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.dataflow.dataflow_runner import DataflowPipelineResult
    from apache_beam.runners.dataflow.internal import apiclient

    client = apiclient.DataflowApplicationClient(PipelineOptions(options))
    job = client.get_job(job_id)
    return {"job_id": job_id, "state": str(DataflowPipelineResult.api_jobstate_to_pipeline_state(job.current_state))}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m pipeline.cloud.dataflow_launch", description=__doc__.split("\n")[0],
                                  epilog="After --: the job's DataflowRunner options (for state: project and region).")
    commands = top.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="submit one stage as a Dataflow job")
    run.add_argument("stage", choices=STAGES)
    run.add_argument("--out", required=True)
    run.add_argument("--settings", help="the run's settings as JSON (plan only)")
    run.add_argument("--overwrite", action="store_true", help="delete an earlier run in OUT first (plan only)")
    run.add_argument("--cap-hosts", type=int, help="the per-device batch was chosen by auto: lower it to what the "
                     "run fills on this many hosts (plan only)")
    state = commands.add_parser("state", help="a Dataflow job's state")
    state.add_argument("job_id")
    return top


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's own arguments, the Dataflow options after ``--``). The options are split
    off first: argparse's subcommands do not pass ``--`` and what follows it through reliably."""
    if "--" in argv:
        cut = argv.index("--")
        argv, options = argv[:cut], argv[cut + 1:]
    else:
        options = []
    return parser().parse_args(argv), options


def main(argv: list[str] | None = None) -> int:
    args, options = parse(sys.argv[1:] if argv is None else list(argv))
    if args.command == "run":
        answer = launch(args.stage, args.out, options, args.settings, args.overwrite, args.cap_hosts)
    else:
        answer = job_state(args.job_id, options)
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
