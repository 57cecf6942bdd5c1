"""``submit dataflow``: the whole job as one Beam pipeline on Dataflow TPU workers.

The beam engine (``pipeline.engines.beam.run_beam``) with DataflowRunner options built
here: a single-host TPU worker per Dataflow worker (``worker_accelerator``), the machine
type Dataflow requires for it, a custom container (Runner v2) and one SDK process per
worker, since a TPU can be opened by one process only. The option builder and the dry
run are pure: ``--dry-run`` prints exactly what would be launched.
"""
from __future__ import annotations

import dataclasses
import json
import shlex

from pipeline.cloud import checks, tpu
from pipeline.core import naming

# Dataflow's batch default (25 GB with Shuffle) is too small for a JAX/libtpu image and a model.
DEFAULT_DISK_SIZE_GB = 100


# Dataflow options this module sets, and the `submit dataflow` flag that sets each.
_OWNED_OPTIONS = {
    "runner": None, "project": "--project", "region": "--region", "temp_location": "--temp-location",
    "staging_location": "--temp-location", "sdk_container_image": "--image", "machine_type": None,
    "worker_machine_type": None, "job_name": "--job-name", "max_num_workers": "--max-workers",
    "number_of_worker_harness_threads": "--harness-threads", "disk_size_gb": "--disk-size-gb",
}


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


def dataflow_options(s: tpu.TpuSlice, *, project: str, region: str, image: str, out: str, job: str,
                     temp_location: str | None = None, max_workers: int = 1, harness_threads: int = 1,
                     disk_size_gb: int = DEFAULT_DISK_SIZE_GB, extra: list[str] | tuple = ()) -> list[str]:
    """The DataflowRunner options for the beam engine on single-host TPU workers ``s``.

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
    for flag, value in (("--max-workers", max_workers), ("--harness-threads", harness_threads),
                        ("--disk-size-gb", disk_size_gb)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    temp = checks.require_gcs("--temp-location", temp_location or naming.join(out, "dataflow", "tmp"), "dataflow")
    staging = naming.join(out, "dataflow", "staging") if temp_location is None else naming.join(temp, "staging")
    owned = [
        ("runner", "DataflowRunner"), ("project", project), ("region", region), ("job_name", job),
        ("temp_location", temp), ("staging_location", staging), ("sdk_container_image", image),
        ("machine_type", s.machine_type), ("dataflow_service_options", f"worker_accelerator={tpu.worker_accelerator(s)}"),
        ("experiments", "use_runner_v2"), ("experiments", "no_use_multiple_sdk_containers"),
        ("number_of_worker_harness_threads", harness_threads), ("max_num_workers", max_workers),
        ("disk_size_gb", disk_size_gb),
    ]
    values = {name: str(value) for name, value in owned}
    values["worker_machine_type"] = s.machine_type
    options = [_option(name, value) for name, value in owned]
    for name, value in parse_beam_args(list(extra)):
        if name in _OWNED_OPTIONS:
            if value == values[name]:
                continue  # the same value twice: keep one
            why = (f"set it with {_OWNED_OPTIONS[name]}" if _OWNED_OPTIONS[name]
                   else f"{s.tpu_type} {s.topology} on Dataflow requires {values[name]}")
            raise ValueError(f"--{name}={value} conflicts with what submit dataflow sets ({values[name]}); {why}")
        if name in ("dataflow_service_options", "dataflow_service_option") and value and \
                value.startswith("worker_accelerator"):
            raise ValueError(f"--{name}={value}: the worker accelerator comes from --tpu-type and --topology "
                             f"({tpu.worker_accelerator(s)})")
        options.append(_option(name, value) if value is not None else f"--{name}")
    return options


def format_options(options: list[str]) -> str:
    """One option a line, each quoted for a POSIX shell."""
    return "\n".join(shlex.quote(option) for option in options)


@dataclasses.dataclass(frozen=True)
class DataflowJob:
    settings: object  # pipeline.core.settings.Settings, devices_per_host = the worker's chips
    tpu_slice: tpu.TpuSlice
    options: tuple[str, ...]
    overwrite: bool = False


def dataflow_dry_run(job: DataflowJob) -> str:
    """What ``submit dataflow --dry-run`` prints: the settings and every option, one a line."""
    return "\n".join([
        f"# promptmill submit dataflow --dry-run: nothing was launched. It would call "
        f"pipeline.engines.beam.run_beam(settings, options, overwrite={job.overwrite}) with:",
        f"# worker: {job.tpu_slice.describe()}",
        "# settings:",
        json.dumps(job.settings.to_dict(), sort_keys=True),
        "# options (one a line, shell-quoted):",
        format_options(list(job.options)),
    ])


def submit_dataflow(job: DataflowJob):
    """Launch the beam engine on Dataflow; returns what ``run_beam`` returns."""
    from pipeline.engines import (  # lazily: Beam's Dataflow runner is heavy, and not needed for a dry run
        beam as beam_engine,
    )

    return beam_engine.run_beam(job.settings, list(job.options), overwrite=job.overwrite)
