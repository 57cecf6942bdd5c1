"""Production submission: the whole job on Dataflow TPU workers, or generate on a GKE TPU slice.

Two targets (``promptmill submit dataflow`` | ``gke``):

* **dataflow**: the beam engine (``pipeline.engines.beam.run_beam``) with DataflowRunner
  options built here: a single-host TPU worker per Dataflow worker
  (``worker_accelerator``), the machine type Dataflow requires for it, a custom container
  (Runner v2) and one SDK process per worker, since a TPU can be opened by one process only.
* **gke**: ``plan`` (Beam, local by default), a JobSet with one pod per TPU host running
  ``promptmill generate --out OUT`` (the hosts form the jax.distributed cluster from
  ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES`` and ``PROMPTMILL_COORDINATOR_PORT``),
  ``kubectl apply``, a wait that follows the committed slices and the JobSet's
  conditions, then ``collect``. A failed or restarted JobSet loses nothing: hosts skip
  committed slices, so a restart, or re-running the same command, resumes.

The renderers and option builders are pure, so ``--dry-run`` prints exactly what would
run and the tests check every supported slice without a cluster.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time
from typing import Callable

from pipeline.core import naming
from pipeline.cloud import dates as schedule
from pipeline.io import storage
from pipeline.cloud import tpu

DEFAULT_COORDINATOR_PORT = 8476  # jax.distributed's usual coordinator port
DEFAULT_DISK_SIZE_GB = 100  # Dataflow's batch default (25 GB with Shuffle) is too small for a JAX/libtpu image and a model
DEFAULT_POLL_S = 30.0
KUBECTL_TIMEOUT_S = 300
KUBECTL_FAILURES_TOLERATED = 5  # consecutive failed status polls before the wait gives up
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "hosts"  # the JobSet's one replicatedJob; pod host names are NAME-hosts-0-I
CONTAINER = "promptmill"
TPU_RUNTIME_PORT = 8471  # the port TPU VMs of a multi-host slice talk on (GKE's TPU examples expose it)


def require_gcs(flag: str, value: str | None, target: str) -> str:
    """``value`` if it is a gs:// path, else a ValueError naming the flag and the fix."""
    if not value or not storage.is_gcs(value) or len(value.rstrip("/")) <= len("gs://"):
        raise ValueError(f"{flag} must be a gs://BUCKET/PREFIX path for submit {target} (its workers read and "
                         f"write Cloud Storage, not this machine's disk), got {value!r}")
    return value


def require_remote_model(model: str, target: str) -> str:
    """``model`` unless it is a folder on this machine, which the workers cannot see."""
    if model != "tiny" and not storage.is_gcs(model) and os.path.exists(model):
        raise ValueError(f"--model {model!r} is a folder on this machine, which the {target} workers cannot read: "
                         f"copy it to gs://BUCKET/models/NAME and pass that (or bake it into the image)")
    return model


def require_value(flag: str, value, target: str, example: str):
    if value is None or value == "":
        raise ValueError(f"submit {target} needs {flag}, e.g. {flag} {example}")
    return value


def job_name(out: str, name: str | None = None, date: str | None = None) -> str:
    """The Dataflow job / JobSet name: ``name`` (or ``promptmill-`` and a hash of OUT) and the date.

    Without ``--name`` the name follows from OUT, so re-running the same command finds
    the same JobSet (and Dataflow refuses a second running job of one name) instead of
    starting a second one on the same OUT. ``schedule.job_name`` keeps it a valid
    Kubernetes and Dataflow name and appends the scheduled date.
    """
    prefix = name or f"promptmill-{hashlib.sha256(out.rstrip('/').encode()).hexdigest()[:8]}"
    return schedule.job_name(prefix, date)


# ---------------------------------------------------------------- Dataflow


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


def dataflow_options(s: tpu.Slice, *, project: str, region: str, image: str, out: str, job: str,
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
    temp = require_gcs("--temp-location", temp_location or naming.join(out, "dataflow", "tmp"), "dataflow")
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
    slice: tpu.Slice
    options: tuple[str, ...]
    overwrite: bool = False


def dataflow_dry_run(job: DataflowJob) -> str:
    """What ``submit dataflow --dry-run`` prints: the settings and every option, one a line."""
    return "\n".join([
        f"# promptmill submit dataflow --dry-run: nothing was launched. It would call "
        f"pipeline.engines.beam.run_beam(settings, options, overwrite={job.overwrite}) with:",
        f"# worker: {job.slice.describe()}",
        "# settings:",
        json.dumps(job.settings.to_dict(), sort_keys=True),
        "# options (one a line, shell-quoted):",
        format_options(list(job.options)),
    ])


def submit_dataflow(job: DataflowJob):
    """Launch the beam engine on Dataflow; returns what ``run_beam`` returns."""
    from pipeline.engines import beam as beam_engine  # lazily: Beam's Dataflow runner is heavy, and not needed for a dry run

    return beam_engine.run_beam(job.settings, list(job.options), overwrite=job.overwrite)


# ---------------------------------------------------------------- GKE


def host_command(out: str) -> list[str]:
    """The container command of every host: no cluster flags, the cluster comes from the env."""
    return ["promptmill", "generate", "--out", out]


def worker_hostnames(name: str, hosts: int, subdomain: str | None = None) -> list[str]:
    """The pods' DNS names: JobSet names pod I of job 0 of a replicatedJob ``NAME-RJOB-0-I``,
    reachable as ``HOSTNAME.SUBDOMAIN`` through the JobSet's headless service."""
    domain = subdomain or name
    return [f"{name}-{REPLICATED_JOB}-0-{i}.{domain}" for i in range(hosts)]


@dataclasses.dataclass(frozen=True)
class GkeJob:
    settings: object  # pipeline.core.settings.Settings, devices_per_host = chips per host
    slice: tpu.Slice
    name: str
    image: str
    namespace: str = "default"
    max_restarts: int = 3
    coordinator_port: int = DEFAULT_COORDINATOR_PORT
    service_account: str | None = None
    plan_beam_args: tuple[str, ...] = ()
    collect_beam_args: tuple[str, ...] = ()
    overwrite: bool = False
    poll_s: float = DEFAULT_POLL_S

    @property
    def out(self) -> str:
        return self.settings.out

    def validate(self) -> "GkeJob":
        if not 1 <= self.coordinator_port <= 65535:
            raise ValueError(f"--coordinator-port must be in [1, 65535], got {self.coordinator_port}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.poll_s <= 0:
            raise ValueError(f"--poll-seconds must be > 0, got {self.poll_s}")
        if not 1 <= len(self.name) <= 40 or self.name != schedule.job_name(self.name):
            raise ValueError(f"--name must be lowercase letters, digits and '-', starting with a letter, at most 40 "
                             f"characters (JobSet pod host names add suffixes), got {self.name!r}")
        return self


def jobset(job: GkeJob) -> dict:
    """The JobSet of ``job``: one replicatedJob, one Indexed Job, one pod per TPU host.

    * ``parallelism = completions = hosts`` and ``completionMode: Indexed``: pod I is
      host I (``TPU_WORKER_ID`` from the ``batch.kubernetes.io/job-completion-index``
      annotation, through the downward API);
    * ``backoffLimit: 0``: one host failing fails the Job, and the JobSet restarts all
      hosts together (``failurePolicy.maxRestarts``), since jax.distributed cannot take
      a replaced host; committed slices are skipped on restart, so nothing is redone;
    * ``network.enableDNSHostnames`` with a subdomain: the JobSet's headless service
      gives every pod the DNS name listed in ``TPU_WORKER_HOSTNAMES``; host 0's runs the
      coordinator on ``PROMPTMILL_COORDINATOR_PORT``;
    * ``alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool``:
      the slice's pods get a node pool (one TPU slice) to themselves;
    * node selectors for the TPU type and topology, and ``google.com/tpu`` = the chips
      of one host (requests = limits), which also picks the machine type (e.g. v5e 2x4:
      8 chips on one ct5lp-hightpu-8t, or 4 on each of two ct5lp-hightpu-4t).
    No privileged mode or host network: GKE 1.28+ gives TPU containers their devices
    without it, and the hosts only talk to each other and to Cloud Storage.
    """
    s = job.slice
    hostnames = worker_hostnames(job.name, s.hosts)
    chips = str(s.chips_per_host)
    env = [
        {"name": "TPU_WORKER_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "TPU_WORKER_HOSTNAMES", "value": ",".join(hostnames)},
        {"name": "PROMPTMILL_COORDINATOR_PORT", "value": str(job.coordinator_port)},
    ]
    container = {
        "name": CONTAINER, "image": job.image, "command": host_command(job.out), "env": env,
        "ports": [{"name": "coordinator", "containerPort": job.coordinator_port},
                  {"name": "tpu-runtime", "containerPort": TPU_RUNTIME_PORT}],
        "resources": {"requests": {"google.com/tpu": chips}, "limits": {"google.com/tpu": chips}},
    }
    if job.coordinator_port == TPU_RUNTIME_PORT:
        container["ports"] = container["ports"][:1]
    pod_spec = {"subdomain": job.name, "restartPolicy": "Never", "nodeSelector": tpu.node_selector(s),
                "containers": [container]}
    if job.service_account:
        pod_spec["serviceAccountName"] = job.service_account
    labels = {"app.kubernetes.io/name": "promptmill", "app.kubernetes.io/component": "generate"}
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": job.name, "namespace": job.namespace, "labels": dict(labels),
                     "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool",
                                     "promptmill/out": job.out, "promptmill/slice": s.describe()}},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": job.name},
            "failurePolicy": {"maxRestarts": job.max_restarts},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"spec": {
                    "parallelism": s.hosts, "completions": s.hosts, "completionMode": "Indexed", "backoffLimit": 0,
                    "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
                }},
            }],
        },
    }


def manifests(job: GkeJob) -> list[dict]:
    """Every object ``kubectl apply`` gets (the JobSet makes its own headless service)."""
    return [jobset(job)]


def to_yaml(docs: list[dict]) -> str:
    """Multi-document YAML, keys in the order written."""
    import yaml

    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def plan_command(settings, beam_args: list[str] | tuple = ()) -> list[str]:
    """The ``promptmill plan`` command line that plans ``settings`` (what submit gke runs first)."""
    d = settings.to_dict()
    command = ["promptmill", "plan", "--prompts", d["prompts"], "--out", d["out"], "--model", d["model"]]
    for flag, key in (("--width", "width"), ("--height", "height"), ("--scheduler", "scheduler")):
        if d[key] is not None:
            command += [flag, str(d[key])]
    command += ["--steps", str(d["steps"]), "--dtype", d["dtype"], "--format", ",".join(d["formats"]),
                "--image-format", d["image_format"], "--quality", str(d["quality"]),
                "--guidance-scale", repr(float(d["guidance_scale"])), "--seed", str(d["seed"]),
                "--per-device-batch", str(d["per_device_batch"]), "--batches-per-slice", str(d["batches_per_slice"]),
                "--devices-per-host", str(d["devices_per_host"]), "--prompt-field", d["prompt_field"]]
    for flag, key in (("--save-latents", "save_latents"), ("--dedupe", "dedupe")):
        if d[key]:
            command.append(flag)
    return command + list(beam_args)


def kubectl_base(namespace: str, kubectl: str = "kubectl") -> list[str]:
    return [kubectl, "--namespace", namespace]


def find_kubectl() -> str:
    """``KUBECTL``, or ``kubectl`` on PATH; a clear error when there is none."""
    override = os.environ.get("KUBECTL")
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise RuntimeError(f"KUBECTL={override!r} is not an executable file")
        return override
    found = shutil.which("kubectl")
    if not found:
        raise RuntimeError("kubectl was not found on PATH: install it (e.g. `gcloud components install kubectl`), "
                           "point it at the cluster (`gcloud container clusters get-credentials CLUSTER`), "
                           "or set KUBECTL=/path/to/kubectl")
    return found


def gke_dry_run(job: GkeJob) -> str:
    """What ``submit gke --dry-run`` prints: every command, then the manifests (valid multi-document YAML)."""
    job.validate()
    base = " ".join(shlex.quote(p) for p in kubectl_base(job.namespace, os.environ.get("KUBECTL") or "kubectl"))
    stats = naming.join(job.out, "shards", "*_stats.json")
    collect = ["promptmill", "collect", "--out", job.out, *job.collect_beam_args]
    lines = [
        "# promptmill submit gke --dry-run: nothing was run. It would run, in order:",
        f"# slice: {job.slice.describe()}",
        "# 1. plan (Beam):",
        "#    " + shlex.join(plan_command(job.settings, job.plan_beam_args) + (["--overwrite"] if job.overwrite else [])),
        f"# 2. {base} get jobset {job.name} -o json --ignore-not-found"
        "   (a finished JobSet of this name is deleted first; a running one is waited on, not applied again)",
        f"# 3. {base} apply -f -   (stdin: the manifest below)",
        f"# 4. wait: every {job.poll_s:g} s count {stats} (committed slices) and read "
        f"`{base} get jobset {job.name} -o json` until its Completed condition (a Failed one is an error)",
        "# 5. collect (Beam):",
        "#    " + shlex.join(collect),
        "# settings: " + json.dumps(job.settings.to_dict(), sort_keys=True),
    ]
    return "\n".join(lines) + "\n---\n" + to_yaml(manifests(job))


def jobset_state(obj: dict | None) -> tuple[str, str]:
    """(``absent`` | ``running`` | ``completed`` | ``failed``, message) from ``kubectl get jobset -o json``."""
    if not obj:
        return "absent", "no such JobSet"
    status = obj.get("status") or {}
    for condition in status.get("conditions") or []:
        if str(condition.get("status")).lower() != "true":
            continue
        text = "; ".join(str(condition[k]) for k in ("reason", "message") if condition.get(k))
        if condition.get("type") == "Failed":
            return "failed", text or "Failed"
        if condition.get("type") == "Completed":
            return "completed", text or "Completed"
    terminal = status.get("terminalState")
    if terminal in ("Completed", "Failed"):
        return terminal.lower(), terminal
    return "running", f"restarts: {status.get('restarts', 0)}"


def committed_slices(out: str, total: int) -> int:
    """How many of the planned slices have their commit marker (``shards/NNNNN_stats.json``)."""
    found = set(storage.glob(naming.join(out, "shards", "*_stats.json")))
    return sum(naming.shard_stats(out, i) in found for i in range(total))


class Kubectl:
    """Runs kubectl in one namespace; a failed call is a RuntimeError with its stderr."""

    def __init__(self, namespace: str, path: str | None = None):
        self.base = kubectl_base(namespace, path or find_kubectl())

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        command = [*self.base, *args]
        try:
            done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`{shlex.join(command)}` did not finish in {KUBECTL_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"`{shlex.join(command)}` failed (exit code {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        return done.stdout

    def get_jobset(self, name: str) -> dict | None:
        text = self("get", "jobset", name, "-o", "json", "--ignore-not-found")
        return json.loads(text) if text.strip() else None


def apply_jobset(kubectl: Kubectl, job: GkeJob, emit: Callable[[str], None]) -> str:
    """Create the JobSet: apply it; replace a finished one of the same name; attach to a running one."""
    state, _ = jobset_state(kubectl.get_jobset(job.name))
    if state == "running":
        emit(f"JobSet {job.name} is already running: waiting for it instead of applying it again")
        return "attached"
    if state in ("completed", "failed"):
        emit(f"JobSet {job.name} exists and is {state}: deleting it so a new one resumes {job.out}")
        kubectl("delete", "jobset", job.name, "--wait=true")
    kubectl("apply", "-f", "-", stdin=to_yaml(manifests(job)))
    emit(f"JobSet {job.name} applied: {job.slice.describe()}")
    return "applied"


def wait_for_jobset(kubectl: Kubectl, job: GkeJob, total: int, emit: Callable[[str], None],
                    sleep: Callable[[float], None] = time.sleep) -> int:
    """Poll until the JobSet completes with every slice committed; returns the committed count.

    Prints ``committed/total`` and the JobSet's restarts whenever they change. A Failed JobSet, a JobSet that
    disappears, or one that completes with slices missing is a RuntimeError; so are
    ``KUBECTL_FAILURES_TOLERATED`` failed status calls in a row.
    """
    last = None
    last_status = None
    failures = 0
    while True:
        done = committed_slices(job.out, total)
        if done != last:
            emit(f"{done}/{total} slices committed")
            last = done
        try:
            state, message = jobset_state(kubectl.get_jobset(job.name))
            failures = 0
        except (RuntimeError, ValueError) as e:
            failures += 1
            if failures >= KUBECTL_FAILURES_TOLERATED:
                raise RuntimeError(f"could not read JobSet {job.name}'s status {failures} times in a row: {e}") from e
            sleep(job.poll_s)
            continue
        resume = "committed slices are kept: re-running the same command resumes"
        if state == "failed":
            raise RuntimeError(f"JobSet {job.name} failed ({message}) with {committed_slices(job.out, total)}/{total} "
                               f"slices committed; see `kubectl --namespace {job.namespace} logs -l "
                               f"jobset.sigs.k8s.io/jobset-name={job.name}`; {resume}")
        if state == "absent":
            raise RuntimeError(f"JobSet {job.name} disappeared with {done}/{total} slices committed; {resume}")
        if state == "completed":
            done = committed_slices(job.out, total)
            if done != last:
                emit(f"{done}/{total} slices committed")
            if done < total:
                raise RuntimeError(f"JobSet {job.name} completed but only {done}/{total} slices are committed in "
                                   f"{job.out}; {resume}")
            return done
        if message != last_status:  # started, or restarted after a host failed
            emit(f"JobSet {job.name} running ({message})")
            last_status = message
        sleep(job.poll_s)


def submit_gke(job: GkeJob, emit: Callable[[str], None] = print, kubectl: Kubectl | None = None,
               sleep: Callable[[float], None] = time.sleep) -> dict:
    """plan -> kubectl apply -> wait -> collect; returns collect's stats."""
    job.validate()
    from pipeline.collect import transforms as collect
    from pipeline.plan import transforms as plan

    kubectl = kubectl or Kubectl(job.namespace)  # a missing kubectl fails here, before anything is done
    manifest = plan.run_plan(job.settings, list(job.plan_beam_args), job.overwrite)
    emit(f"planned {manifest['records']} records, {manifest['images']} images in {manifest['slices']} slices "
         f"for {job.slice.hosts} host(s) x {job.slice.chips_per_host} chips")
    apply_jobset(kubectl, job, emit)
    wait_for_jobset(kubectl, job, manifest["slices"], emit, sleep)
    return collect.run_collect(job.out, list(job.collect_beam_args))


def example_manifest() -> str:
    """``infra/gke/jobset.example.yaml``: the JobSet of one example run, as ``submit gke`` renders it.

    Regenerate the file with ``python -c "from pipeline import submit; print(submit.example_manifest(), end='')"
    > infra/gke/jobset.example.yaml``; a test checks the two are equal.
    """
    from pipeline.core.settings import Settings

    s = tpu.lookup("v5e", "4x4")
    out = "gs://BUCKET/runs/2025-01-31"
    job = GkeJob(settings=Settings(prompts="gs://BUCKET/prompts/*.jsonl", out=out, devices_per_host=s.chips_per_host),
                 slice=s, name=job_name(out, "promptmill", "2025-01-31"),
                 image="REGION-docker.pkg.dev/PROJECT/REPO/promptmill:TAG", service_account="promptmill")
    header = [
        "# The JobSet `promptmill submit gke` applies for one example run, rendered by",
        "# pipeline.cloud.submit.example_manifest() (a test keeps this file equal to it; do not edit by hand):",
        "#   promptmill submit gke --tpu-type v5e --topology 4x4 --image REGION-docker.pkg.dev/PROJECT/REPO/promptmill:TAG \\",
        "#     --prompts 'gs://BUCKET/prompts/*.jsonl' --out 'gs://BUCKET/runs/{date}' --date 2025-01-31 \\",
        "#     --name promptmill --service-account promptmill",
        f"# {s.describe()}: one pod per host, each asking for its host's {s.chips_per_host} chips.",
        "# `submit gke` runs plan before applying it and collect after it completes.",
    ]
    return "\n".join(header) + "\n---\n" + to_yaml(manifests(job))
