"""The stages of ``submit dataflow`` as Dataflow jobs: each stage's pipeline built and submitted,
and a job's state read (the Dataflow launcher's work).

``submit dataflow`` runs the launcher as a subprocess, the one place it talks to Dataflow (as
``pipeline.cloud.kubectl`` is for ``submit gke``), and ``DATAFLOW_LAUNCHER`` replaces it
with another executable (the tests point it at a fake). Its command line is
``jobs.dataflow_launcher`` (``python -m jobs.dataflow_launcher``), which reads the plan's settings
flags with the CLI's own parser and calls ``launch`` or ``job_state`` here. Each call prints
one JSON line, ``{"job_id": ..., "state": ...}``, where the state is one of Beam's
``PipelineState`` names (``RUNNING``, ``DONE``, ``FAILED``, ...), and exits 0; a failure exits
non-zero with the reason on stderr.

``launch`` builds the stage's pipeline and submits it with the DataflowRunner options, and
returns once Dataflow has accepted it (it does not wait for the job):

  plan      ``prepare`` (run.json) here, then ``pipeline.plan.transforms.Plan``, as ``promptmill plan``
            (a resumed run whose plan is finished keeps it, and no job is submitted)
  generate  ``pipeline.engines.beam.build_generate`` over the planned slices (manifest.json)
  collect   ``pipeline.collect.transforms.Collect``, as ``promptmill collect``
"""
from __future__ import annotations

STAGES = ("plan", "generate", "collect")


def build_stage(p, stage: str, out: str, settings=None, overwrite: bool = False,
                cap_hosts: int | None = None) -> dict | None:
    """Put ``stage``'s transforms for ``out`` on the pipeline ``p``; ``settings`` (a Settings
    whose ``out`` is ``out``), ``overwrite`` and ``cap_hosts`` (see
    ``pipeline.plan.transforms.Plan``): plan only. Returns the manifest of a finished plan
    that a resumed run keeps (``kept_plan``), and then puts nothing on ``p``."""
    import apache_beam as beam

    from pipeline.core import naming
    from pipeline.io import beamio, runs, storage

    beamio.require_filesystem(out)
    if stage == "plan":
        from pipeline.plan import transforms as plan
        from pipeline.plan.prepare import prepare

        if settings is None or settings.out != out:
            raise ValueError(f"the plan of {out} needs its settings, with that out")
        resuming = not overwrite and runs.exists(out)
        settings, _ = prepare(settings, overwrite)
        kept = plan.kept_plan(out) if resuming else None
        if kept is None:
            _ = p | "Plan" >> plan.Plan(settings, cap_hosts)
        return kept
    runs.read(out)  # a clear error when nothing was planned in OUT
    manifest = storage.read_json(naming.manifest(out))
    if stage == "generate":
        from pipeline.engines import beam as beam_engine
        from pipeline.io import ledgers

        ledgers.forget(out)  # its workers keep none: status and a later pod run list the markers
        beam_engine.build_generate(p, out, manifest["slices"])
        return
    if stage == "collect":
        from pipeline.collect import transforms as collect

        _ = (p
             | "Manifest" >> beam.Create([manifest])
             | "Collect" >> collect.Collect(out, runs.read(out)))
        return
    raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")


def launch(stage: str, out: str, options: list[str], settings=None, overwrite: bool = False,
           cap_hosts: int | None = None) -> dict:
    """Submit ``stage`` as a Dataflow job; ``{"job_id", "state"}`` once Dataflow accepted it. A
    resumed run whose plan is finished keeps it: nothing is submitted, and the answer is
    ``{"job_id": "", "state": "DONE", "plan_kept": true}``."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    p = beam.Pipeline(options=PipelineOptions(options))
    if build_stage(p, stage, out, settings, overwrite, cap_hosts) is not None:
        return {"job_id": "", "state": "DONE", "plan_kept": True}
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
