"""promptmill submit gke: the rendered JobSet for every supported slice, schema checks, dry runs,
the wait loop, and a real GKE-style run against a fake kubectl that starts the manifest's hosts
as local processes (GCS emulator, tiny model)."""
import json
import os
import re

import pytest
import yaml

from pipeline.cloud import checks, gke, jobset, kubectl as kubectl_lib, tpu
from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage
from tests.cloud.test_submit import GKE, IMAGE, OUT, PROMPTS, _commit, _interrupt, cli_main, given
from tests.conftest import ROOT

K8S_VERSION = "1.33.0"  # a recent Kubernetes (GKE's regular channel runs 1.33)
SLICE_IDS = [f"{s.tpu_type}-{s.topology}-{s.machine_type}" for s in tpu.SLICES]


def gke_job(s: tpu.TpuSlice, **changes) -> jobset.GkeJob:
    fields = dict(settings=Settings(prompts=PROMPTS, out=OUT, devices_per_host=s.chips_per_host), tpu_slice=s,
                  name="pm-test", image=IMAGE, namespace="team-a", max_restarts=5, coordinator_port=9123,
                  service_account="promptmill-ksa")
    fields.update(changes)
    return jobset.GkeJob(**fields).validate()


# ---------------------------------------------------------------- schema checks

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
JOBSET_SPEC = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
               "coordinator", "managedBy", "ttlSecondsAfterFinished", "volumeClaimPolicies"}
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
NETWORK = {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
FAILURE_POLICY = {"maxRestarts", "restartStrategy", "rules"}


def jobset_problems(obj: dict) -> list[str]:
    """The JobSet API's (jobset.x-k8s.io/v1alpha2) required fields and types, checked by hand:
    no schema of the CRD is bundled with kubernetes-validate."""
    problems = []
    if obj.get("apiVersion") != "jobset.x-k8s.io/v1alpha2" or obj.get("kind") != "JobSet":
        problems.append("apiVersion/kind")
    name = (obj.get("metadata") or {}).get("name", "")
    if not (DNS_LABEL.fullmatch(name) and len(name) <= 63):
        problems.append(f"metadata.name {name!r}")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return problems + ["spec"]
    problems += [f"spec.{k} unknown" for k in set(spec) - JOBSET_SPEC]
    jobs = spec.get("replicatedJobs")
    if not isinstance(jobs, list) or not jobs:
        return problems + ["spec.replicatedJobs must be a non-empty list"]
    names = [j.get("name") for j in jobs]
    if len(set(names)) != len(names):
        problems.append("replicatedJobs names not unique")
    for job in jobs:
        problems += [f"replicatedJobs[].{k} unknown" for k in set(job) - REPLICATED_JOB]
        if not (isinstance(job.get("name"), str) and DNS_LABEL.fullmatch(job["name"])):
            problems.append(f"replicatedJobs[].name {job.get('name')!r}")
        if not (isinstance(job.get("replicas", 1), int) and job.get("replicas", 1) >= 0):
            problems.append("replicatedJobs[].replicas")
        template = job.get("template")
        if not (isinstance(template, dict) and isinstance(template.get("spec"), dict)
                and isinstance(template["spec"].get("template"), dict)):
            problems.append("replicatedJobs[].template must be a JobTemplateSpec")
            continue
        completions = template["spec"].get("completions", 1)
        hostname = f"{name}-{job.get('name')}-{job.get('replicas', 1) - 1}-{completions - 1}"
        if len(hostname) > 63:
            problems.append(f"pod host name {hostname!r} is longer than 63")
    network = spec.get("network", {})
    problems += [f"spec.network.{k} unknown" for k in set(network) - NETWORK]
    if "enableDNSHostnames" in network and not isinstance(network["enableDNSHostnames"], bool):
        problems.append("spec.network.enableDNSHostnames")
    if "subdomain" in network and not DNS_LABEL.fullmatch(str(network["subdomain"])):
        problems.append("spec.network.subdomain")
    failure = spec.get("failurePolicy", {})
    problems += [f"spec.failurePolicy.{k} unknown" for k in set(failure) - FAILURE_POLICY]
    if not (isinstance(failure.get("maxRestarts", 0), int) and failure.get("maxRestarts", 0) >= 0):
        problems.append("spec.failurePolicy.maxRestarts")
    return problems


def embedded_job(js: dict) -> dict:
    """The batch/v1 Job the JobSet controller makes from the replicatedJob's template."""
    rjob = js["spec"]["replicatedJobs"][0]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{js['metadata']['name']}-{rjob['name']}-0",
                         "namespace": js["metadata"]["namespace"], **rjob["template"].get("metadata", {})},
            "spec": rjob["template"]["spec"]}


def validate_k8s(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


# ---------------------------------------------------------------- every TPU slice: JobSet


@pytest.mark.parametrize("s", tpu.SLICES, ids=SLICE_IDS)
def test_jobset_for_every_slice(s):
    js = jobset.jobset(gke_job(s))
    assert jobset_problems(js) == []
    assert js["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == \
        "cloud.google.com/gke-nodepool"
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "pm-test"}
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 5}
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 1
    job = rjob["template"]["spec"]
    assert job["parallelism"] == job["completions"] == s.hosts
    assert (job["completionMode"], job["backoffLimit"]) == ("Indexed", 0)
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": s.accelerator,
                                   "cloud.google.com/gke-tpu-topology": s.topology}
    assert (pod["restartPolicy"], pod["subdomain"], pod["serviceAccountName"]) == ("Never", "pm-test",
                                                                                   "promptmill-ksa")
    (container,) = pod["containers"]
    assert container["image"] == IMAGE
    assert container["command"] == ["promptmill", "generate", "--out", OUT]  # no cluster flags: the env has them
    chips = str(s.chips_per_host)
    assert container["resources"] == {"requests": {"google.com/tpu": chips}, "limits": {"google.com/tpu": chips}}
    env = {e["name"]: e for e in container["env"]}
    assert set(env) == {"TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "PROMPTMILL_COORDINATOR_PORT", "PROMPTMILL_LEASE_OWNER"}
    assert env["PROMPTMILL_LEASE_OWNER"]["value"] == f"gke:{js['metadata']['namespace']}/pm-test"  # renewed by the hosts
    assert env["TPU_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["TPU_WORKER_HOSTNAMES"]["value"].split(",") == \
        [f"pm-test-hosts-0-{i}.pm-test" for i in range(s.hosts)]
    assert env["PROMPTMILL_COORDINATOR_PORT"]["value"] == "9123"
    assert {"name": "coordinator", "containerPort": 9123} in container["ports"]
    # valid YAML that round-trips, and a valid batch/v1 Job inside
    assert list(yaml.safe_load_all(jobset.to_yaml(jobset.manifests(gke_job(s))))) == [js]
    validate_k8s(embedded_job(js))


def test_the_schema_checks_can_fail():
    import kubernetes_validate

    js = jobset.jobset(gke_job(tpu.lookup("v5e", "4x4")))
    broken = json.loads(json.dumps(js))
    broken["spec"]["replicatedJobs"][0]["replica"] = 2
    broken["spec"]["network"]["enableDNSHostnames"] = "yes"
    broken["metadata"]["name"] = "Bad_Name"
    assert set(jobset_problems(broken)) == {"replicatedJobs[].replica unknown", "spec.network.enableDNSHostnames",
                                            "metadata.name 'Bad_Name'"}
    assert jobset_problems({**js, "spec": {"replicatedJobs": []}}) == ["spec.replicatedJobs must be a non-empty list"]
    long = json.loads(json.dumps(js))
    long["metadata"]["name"] = "x" * 60
    assert any("longer than 63" in p for p in jobset_problems(long))
    job = embedded_job(js)
    job["spec"]["parallelism"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(job)
    job = embedded_job(js)
    job["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(job)


def test_the_example_manifest_is_what_the_renderer_writes():
    """infra/gke/jobset.example.yaml is rendered by jobset.example_manifest(): it cannot drift."""
    with open(os.path.join(ROOT, "infra", "gke", "jobset.example.yaml")) as f:
        assert f.read() == jobset.example_manifest()
    (js,) = yaml.safe_load_all(jobset.example_manifest().split("\n---\n", 1)[1])
    assert jobset_problems(js) == [] and js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 4


# ---------------------------------------------------------------- the CLI


def test_gke_dry_run_prints_every_command_and_the_manifest_and_runs_nothing(kubectl, capsys):
    code, out, err = cli_main([*GKE, "--date", "2025-01-31", "--namespace", "team-a", "--plan-beam-args",
                               "--runner DirectRunner --direct_num_workers 2", "--dry-run"], capsys)
    assert code == 0, err
    assert kubectl() == []  # kubectl never ran
    name = checks.job_name(OUT, None, "2025-01-31")
    assert name.endswith("-20250131")
    docs = [d for d in yaml.safe_load_all(out) if d is not None]  # the whole output is YAML: comments + manifest
    s = tpu.lookup("v5e", "4x4")
    settings = Settings(prompts=PROMPTS, out=OUT, steps=4, devices_per_host=4)
    assert docs == [jobset.jobset(jobset.GkeJob(settings=settings, tpu_slice=s, name=name, image=IMAGE,
                                                namespace="team-a"))]
    kubectl_path = os.environ["KUBECTL"]
    for expected in ("# 1. plan (Beam):",
                     "promptmill plan --prompts 'gs://bucket/prompts/*.jsonl' --out gs://bucket/runs/x",
                     "--devices-per-host 4", "--runner DirectRunner --direct_num_workers 2",
                     f"# 3. {kubectl_path} --namespace team-a apply -f -",
                     f"get jobset {name} -o json", "gs://bucket/runs/x/shards/*_stats.json",
                     "# 5. collect (Beam):", "promptmill collect --out gs://bucket/runs/x"):
        assert expected in out, expected
    assert out.count("# no --service-account: the JobSet's pods run as the namespace's default") == 1
    code, out, err = cli_main([*GKE, "--service-account", "promptmill", "--dry-run"], capsys)
    assert code == 0 and "no --service-account" not in out + err


def test_a_scheduled_gke_dry_run_resolves_date_in_out_and_name(kubectl, capsys):
    code, out, err = cli_main([*given(GKE, "--out", "gs://bucket/runs/{date}"), "--date", "2025-03-01T05:00:00Z",
                               "--name", "nightly", "--dry-run"], capsys)
    assert code == 0, err
    (js,) = [d for d in yaml.safe_load_all(out) if d is not None]
    assert js["metadata"]["name"] == "nightly-20250301"
    container = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["promptmill", "generate", "--out", "gs://bucket/runs/2025-03-01"]


def test_missing_kubectl_is_a_clear_error_before_anything_runs(monkeypatch, tmp_path):
    monkeypatch.delenv("KUBECTL", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="kubectl was not found on PATH"):
        kubectl_lib.find_kubectl()
    monkeypatch.setenv("KUBECTL", str(tmp_path / "nothing"))
    with pytest.raises(RuntimeError, match="is not an executable file"):
        kubectl_lib.find_kubectl()
    monkeypatch.setenv("KUBECTL", "")
    job = gke_job(tpu.lookup("v5e", "4x4"))
    planned = []
    monkeypatch.setattr("pipeline.plan.transforms.run_plan", lambda *a: planned.append(a))
    with pytest.raises(RuntimeError, match="kubectl was not found"):
        gke.submit_gke(job, emit=lambda m: None)
    assert planned == []


# ---------------------------------------------------------------- status and the wait


@pytest.mark.parametrize("obj,state", [
    (None, "absent"),
    ({"status": {}}, "running"),
    ({"status": {"conditions": [{"type": "StartupPolicyCompleted", "status": "True"}]}}, "running"),
    ({"status": {"conditions": [{"type": "Completed", "status": "False"}]}}, "running"),
    ({"status": {"conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted"}]}},
     "completed"),
    ({"status": {"conditions": [{"type": "Failed", "status": "True", "message": "host 1 died"}]}}, "failed"),
    ({"status": {"terminalState": "Failed"}}, "failed"),
])
def test_jobset_state(obj, state):
    assert kubectl_lib.jobset_state(obj)[0] == state


class ScriptedKubectl:
    """Answers `get jobset` from a script of states; records every other call."""

    def __init__(self, states):
        self.states = list(states)
        self.calls = []

    def get_jobset(self, name):
        state = self.states.pop(0)
        if isinstance(state, Exception):
            raise state
        if state is None:
            return None
        restarts = 1 if state == "restarted" else 0
        conditions = {"running": [], "restarted": [], "completed": [{"type": "Completed", "status": "True"}],
                      "failed": [{"type": "Failed", "status": "True", "message": "host 0 OOMKilled"}]}[state]
        return {"metadata": {"name": name}, "status": {"conditions": conditions, "restarts": restarts}}

    def __call__(self, *args, stdin=None):
        self.calls.append((args, stdin))
        return ""


def test_wait_follows_commits_until_completed(tmp_path):
    out = str(tmp_path / "out")
    job = gke_job(tpu.lookup("v5e", "4x4"), settings=Settings(out=out), poll_s=0.01)
    kubectl = ScriptedKubectl(["running", RuntimeError("connection refused"), "restarted", "completed"])
    commits = iter([0, 1, 2])
    messages = []
    assert gke.wait_for_jobset(kubectl, job, 3, messages.append, sleep=lambda s: _commit(out, next(commits))) == 3
    assert messages == ["0/3 slices committed", "JobSet pm-test running (restarts: 0)", "1/3 slices committed",
                        "2/3 slices committed", "JobSet pm-test running (restarts: 1)", "3/3 slices committed"]


def test_wait_fails_clearly_when_the_jobset_fails_or_ends_short(tmp_path):
    out = str(tmp_path / "out")
    job = gke_job(tpu.lookup("v5e", "4x4"), settings=Settings(out=out), poll_s=0.01)
    _commit(out, 0)
    with pytest.raises(RuntimeError) as e:
        gke.wait_for_jobset(ScriptedKubectl(["running", "failed"]), job, 2, lambda m: None, sleep=lambda s: None)
    assert "JobSet pm-test failed (host 0 OOMKilled) with 1/2 slices committed" in str(e.value)
    assert "re-running the same command resumes" in str(e.value)
    with pytest.raises(RuntimeError, match="completed but only 1/2 slices are committed"):
        gke.wait_for_jobset(ScriptedKubectl(["completed"]), job, 2, lambda m: None, sleep=lambda s: None)
    with pytest.raises(RuntimeError, match="disappeared with 1/2 slices committed"):
        gke.wait_for_jobset(ScriptedKubectl([None]), job, 2, lambda m: None, sleep=lambda s: None)
    errors = [RuntimeError("timeout")] * gke.KUBECTL_FAILURES_TOLERATED
    with pytest.raises(RuntimeError, match="could not read JobSet pm-test's status 5 times in a row"):
        gke.wait_for_jobset(ScriptedKubectl(errors), job, 2, lambda m: None, sleep=lambda s: None)


def test_apply_replaces_a_finished_jobset_and_attaches_to_a_running_one():
    job = gke_job(tpu.lookup("v6e", "2x4", "ct6e-standard-4t"))
    fresh, said = ScriptedKubectl([None]), []
    assert gke.apply_jobset(fresh, job, said.append) == "applied"
    assert not any("no --service-account" in m for m in said)  # it has one
    said = []
    assert gke.apply_jobset(ScriptedKubectl([None]), gke_job(tpu.lookup("v6e", "2x4", "ct6e-standard-4t"),
                                                             service_account=None), said.append) == "applied"
    assert sum("no --service-account" in m for m in said) == 1, said
    ((args, stdin),) = fresh.calls
    assert args == ("apply", "-f", "-") and list(yaml.safe_load_all(stdin)) == [jobset.jobset(job)]
    finished = ScriptedKubectl(["failed"])
    assert gke.apply_jobset(finished, job, lambda m: None) == "applied"
    assert [c[0] for c in finished.calls] == [("delete", "jobset", "pm-test", "--wait=true"), ("apply", "-f", "-")]
    running = ScriptedKubectl(["running"])
    assert gke.apply_jobset(running, job, lambda m: None) == "attached" and running.calls == []


# ---------------------------------------------------------------- end to end against a fake kubectl


@pytest.fixture
def gcs_prompts(gcs_emulator, model_cache):
    prefix = f"gs://{gcs_emulator}/submit-e2e"
    rows = [{"prompt": f"submit test prompt {n}", "id": f"rec-{n}"} for n in range(6)]
    storage.write_bytes(f"{prefix}/prompts/part-0.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    return prefix


def _gke_e2e_args(prefix, out):
    return ["submit", "gke", "--tpu-type", "v5e", "--topology", "2x4", "--machine-type", "ct5lp-hightpu-4t",
            "--image", IMAGE, "--prompts", f"{prefix}/prompts/*.jsonl", "--out", out, "--model", "tiny",
            "--steps", "2", "--per-device-batch", "1", "--batches-per-slice", "1", "--poll-seconds", "2",
            "--name", "pm-e2e", "--no-tpu-check", "--dtype", "fp32"]  # (bf16, the default, is emulated on CPU)


def test_gke_end_to_end_with_a_fake_kubectl(gcs_prompts, kubectl, capsys):
    """plan (Beam) -> kubectl apply -> 2 hosts x 4 devices from the manifest's command and env
    (jax.distributed from TPU_WORKER_ID/TPU_WORKER_HOSTNAMES) -> wait -> collect (Beam)."""
    out = f"{gcs_prompts}/out"
    code, stdout, err = cli_main(_gke_e2e_args(gcs_prompts, out), capsys)
    logs = "".join(p.read_text() for p in sorted(kubectl.state.glob("*.log")))
    assert code == 0, err[-3000:] + logs[-3000:]
    assert json.loads(stdout) == {"images": 6, "records": 6, "rejects": 0, "verified": True}
    calls = kubectl()
    base = ["--namespace", "default"]
    assert calls[0] == [*base, "get", "jobset", "pm-e2e", "-o", "json", "--ignore-not-found"]
    assert calls[1] == [*base, "apply", "-f", "-"]
    assert all(c == calls[0] for c in calls[2:]) and len(calls) >= 3  # the wait polls the status
    (applied,) = yaml.safe_load_all((kubectl.state / "applied.yaml").read_text())
    job = applied["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == 2 and applied["metadata"]["name"] == "pm-e2e"
    # both hosts joined one cluster through the env (not flags) and committed the 2 slices
    for i in range(2):
        joins = [json.loads(line) for line in (kubectl.state / f"host-{i}.log").read_text().splitlines()
                 if '"cluster_join"' in line]
        assert joins and joins[0]["how"] == "gke-env" and joins[0]["num_processes"] == 2, joins
    manifest = storage.read_json(naming.manifest(out))
    assert manifest["slices"] == 2 and json.loads(storage.read_text(naming.run_json(out)))["settings"][
        "devices_per_host"] == 4
    assert gke.committed_slices(out, 2) == 2
    assert "2/2 slices committed" in err and "JobSet pm-e2e applied" in err
    assert '"event": "tpu_check_skipped", "reason": "--no-tpu-check"' in err


def test_gke_failed_jobset_is_an_error_and_nothing_is_collected(gcs_prompts, kubectl, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_KUBECTL_MODE", "fail")
    out = f"{gcs_prompts}/out-failed"
    code, stdout, err = cli_main(_gke_e2e_args(gcs_prompts, out), capsys)
    assert code == 1
    assert "JobSet pm-e2e failed (FailedJobs; jobset failed: host 1 exit code 137) with 0/2 slices committed" in err
    assert not storage.exists(naming.dataset_file(out, "stats.json"))
    assert [c[2] for c in kubectl()] == ["get", "apply", "get"]


# ---------------------------------------------------------------- stopped while following


def test_ctrl_c_while_following_a_jobset_leaves_it_running_and_says_how_to_cancel_it(tmp_path):
    out = str(tmp_path / "out")
    job = gke_job(tpu.lookup("v5e", "4x4"), settings=Settings(out=out), poll_s=0.01)
    kubectl = ScriptedKubectl(["running"])
    messages = []
    with pytest.raises(KeyboardInterrupt):
        gke.follow_jobset(kubectl, job, 3, messages.append, sleep=_interrupt)
    assert kubectl.calls == []  # nothing deleted: following stopped, the JobSet did not
    assert messages[-1].startswith("stopped following JobSet pm-test; it keeps running")
    assert f"`promptmill status {out}`" in messages[-1]
    assert re.search(r"cancel it: `\S*kubectl --namespace team-a delete jobset pm-test`", messages[-1])
