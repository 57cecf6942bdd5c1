"""``submit gke``'s manifests: the JobSet that runs ``promptmill generate`` on every host of a TPU slice.

One pod per TPU host runs ``promptmill generate --out OUT``; the hosts form the
jax.distributed cluster from ``TPU_WORKER_ID``, ``TPU_WORKER_HOSTNAMES`` and
``PROMPTMILL_COORDINATOR_PORT``. The renderers are pure, so the dry run prints exactly
what would be applied and the tests check every supported TPU slice without a cluster.
"""
from __future__ import annotations

import dataclasses

from pipeline.cloud import checks, dates as schedule, tpu
from pipeline.cloud.submission import Submission
from pipeline.io import lease

DEFAULT_COORDINATOR_PORT = 8476  # jax.distributed's usual coordinator port
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "hosts"  # the JobSet's one replicatedJob; pod host names are NAME-hosts-0-I
CONTAINER = "promptmill"
TPU_RUNTIME_PORT = 8471  # the port TPU VMs of a multi-host slice talk on (GKE's TPU examples expose it)


def host_command(out: str) -> list[str]:
    """The container command of every host: no cluster flags, the cluster comes from the env."""
    return ["promptmill", "generate", "--out", out]


def worker_hostnames(name: str, hosts: int, subdomain: str | None = None) -> list[str]:
    """The pods' DNS names: JobSet names pod I of job 0 of a replicatedJob ``NAME-RJOB-0-I``,
    reachable as ``HOSTNAME.SUBDOMAIN`` through the JobSet's headless service."""
    domain = subdomain or name
    return [f"{name}-{REPLICATED_JOB}-0-{i}.{domain}" for i in range(hosts)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GkeJob(Submission):
    """A JobSet of one pod per host of the ``tpu_slice``, with its plan and collect commands."""
    name: str
    image: str
    namespace: str = "default"
    max_restarts: int = 3
    coordinator_port: int = DEFAULT_COORDINATOR_PORT
    service_account: str | None = None
    plan_beam_args: tuple[str, ...] = ()
    collect_beam_args: tuple[str, ...] = ()

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


def lease_owner(job: GkeJob) -> str:
    """The name the JobSet's hosts renew the run's lease on OUT by: its own, so that the
    same submit command, run again to follow it, takes the lease up again."""
    return f"gke:{job.namespace}/{job.name}"


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
    s = job.tpu_slice
    hostnames = worker_hostnames(job.name, s.hosts)
    chips = str(s.chips_per_host)
    env = [
        {"name": "TPU_WORKER_ID", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        {"name": "TPU_WORKER_HOSTNAMES", "value": ",".join(hostnames)},
        {"name": "PROMPTMILL_COORDINATOR_PORT", "value": str(job.coordinator_port)},
        {"name": lease.OWNER_ENV, "value": lease_owner(job)},  # the hosts renew the run's lease on OUT
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


def example_manifest() -> str:
    """``infra/gke/jobset.example.yaml``: the JobSet of one example run, as ``submit gke`` renders it.

    Regenerate the file with ``python -c "from pipeline.cloud import jobset; print(jobset.example_manifest(),
    end='')" > infra/gke/jobset.example.yaml``; a test checks the two are equal.
    """
    from pipeline.core.settings import Settings

    s = tpu.lookup("v5e", "4x4")
    out = "gs://BUCKET/runs/2025-01-31"
    job = GkeJob(settings=Settings(prompts="gs://BUCKET/prompts/*.jsonl", out=out, devices_per_host=s.devices_per_host),
                 tpu_slice=s, name=checks.job_name(out, "promptmill", "2025-01-31"),
                 image="REGION-docker.pkg.dev/PROJECT/REPO/promptmill:TAG", service_account="promptmill")
    header = [
        "# The JobSet `promptmill submit gke` applies for one example run, rendered by",
        "# pipeline.cloud.jobset.example_manifest() (a test keeps this file equal to it; do not edit by hand):",
        "#   promptmill submit gke --tpu-type v5e --topology 4x4 --image REGION-docker.pkg.dev/PROJECT/REPO/promptmill:TAG \\",
        "#     --prompts 'gs://BUCKET/prompts/*.jsonl' --out 'gs://BUCKET/runs/{date}' --date 2025-01-31 \\",
        "#     --name promptmill --service-account promptmill",
        f"# {s.describe()}: one pod per host, each asking for its host's {s.chips_per_host} chips.",
        "# `submit gke` runs plan before applying it and collect after it completes.",
    ]
    return "\n".join(header) + "\n---\n" + to_yaml(manifests(job))
