"""promptmill submit dataflow|gke: the rendered JobSet and Dataflow options for every supported
slice, schema checks, dry runs, bad input, the wait loop, and a real GKE-style run against a
fake kubectl that starts the manifest's hosts as local processes (GCS emulator, tiny model)."""
import argparse
import dataclasses
import json
import os
import re
import shlex
import sys
import textwrap

import pytest
import yaml

from pipeline.cloud import checks, dataflow, gke, jobset, kubectl as kubectl_lib, tpu
from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S_VERSION = "1.33.0"  # a recent Kubernetes (GKE's regular channel runs 1.33)
OUT = "gs://bucket/runs/x"
PROMPTS = "gs://bucket/prompts/*.jsonl"
IMAGE = "us-docker.pkg.dev/p/r/promptmill:1"
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


FAKE_KUBECTL = textwrap.dedent(r'''
    #!PYTHON
    """A stand-in for kubectl: records its calls; `apply` starts the JobSet's hosts as local
    processes (one per pod, the pod's command and env; 127.0.0.1 for the pods' DNS names, a free
    port for the coordinator) under a detached supervisor, which writes the JobSet's status."""
    import json, os, socket, subprocess, sys

    STATE = os.environ["FAKE_KUBECTL_STATE"]
    MODE = os.environ.get("FAKE_KUBECTL_MODE", "run")  # run | fail | running (an existing, running JobSet)
    INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


    def path(name):
        return os.path.join(STATE, name)


    def write_status(status):
        with open(path("status.tmp"), "w") as f:
            json.dump(status, f)
        os.replace(path("status.tmp"), path("status.json"))


    def supervise():
        import yaml
        sys.path.insert(0, os.environ["FAKE_KUBECTL_REPO"])
        from pipeline.engines import local as launcher

        (jobset,) = [d for d in yaml.safe_load_all(open(path("applied.yaml"))) if d]
        job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
        container = job["template"]["spec"]["containers"][0]
        chips = int(container["resources"]["limits"]["google.com/tpu"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        assert container["command"][0] == "promptmill"
        command = [sys.executable, "-m", "jobs.cli", *container["command"][1:]]
        hosts = []
        for i in range(job["parallelism"]):
            env = launcher.host_env(chips)
            for var in container["env"]:
                if "value" in var:
                    env[var["name"]] = var["value"]
                else:
                    assert var["valueFrom"]["fieldRef"]["fieldPath"] == INDEX
                    env[var["name"]] = str(i)
            env["TPU_WORKER_HOSTNAMES"] = ",".join("127.0.0.1" for _ in env["TPU_WORKER_HOSTNAMES"].split(","))
            env["PROMPTMILL_COORDINATOR_PORT"] = str(port)
            log = open(path(f"host-{i}.log"), "w")
            hosts.append(subprocess.Popen(command, env=env, cwd=os.environ["FAKE_KUBECTL_REPO"],
                                          stdout=subprocess.DEVNULL, stderr=log))
        codes = [h.wait() for h in hosts]
        if any(codes):
            write_status({"restarts": 0, "terminalState": "Failed", "conditions": [
                {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": f"host exit codes {codes}"}]})
        else:
            write_status({"restarts": 0, "terminalState": "Completed", "conditions": [
                {"type": "Completed", "status": "True", "reason": "AllJobsCompleted", "message": "jobset completed"}]})


    def main():
        if sys.argv[1:] == ["__supervise__"]:
            return supervise()
        args = sys.argv[1:]
        stdin = sys.stdin.read() if "-f" in args else None
        with open(path("calls.jsonl"), "a") as f:
            f.write(json.dumps(args) + "\n")
        if args[:1] == ["--namespace"]:
            args = args[2:]
        if args[0] == "apply" and args[1:] == ["-f", "-"]:
            with open(path("applied.yaml"), "w") as f:
                f.write(stdin)
            if MODE == "fail":
                write_status({"restarts": 3, "conditions": [{"type": "Failed", "status": "True",
                              "reason": "FailedJobs", "message": "jobset failed: host 1 exit code 137"}]})
            else:
                supervisor = subprocess.Popen([sys.executable, __file__, "__supervise__"], start_new_session=True,
                                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                              stderr=open(path("supervisor.log"), "w"))
                with open(path("supervisor.pid"), "w") as f:
                    f.write(str(supervisor.pid))
            print("jobset.jobset.x-k8s.io/applied")
            return 0
        if args[:2] == ["get", "jobset"]:
            if MODE == "running":
                print(json.dumps({"kind": "JobSet", "metadata": {"name": args[2]}, "status": {"restarts": 0}}))
                return 0
            if not os.path.exists(path("applied.yaml")):
                return 0 if "--ignore-not-found" in args else 1
            status = json.load(open(path("status.json"))) if os.path.exists(path("status.json")) else {"restarts": 0}
            print(json.dumps({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                              "metadata": {"name": args[2]}, "status": status}))
            return 0
        print(f"fake kubectl: unsupported {args}", file=sys.stderr)
        return 2


    sys.exit(main())
''').lstrip().replace("PYTHON", sys.executable)


def fake_executable(tmp_path, monkeypatch, name: str, text: str, variable: str, state_variable: str):
    """Writes the fake ``name`` and points ``variable`` at it; returns a reader of the calls
    it records in its state folder (``calls.state``)."""
    state = tmp_path / f"{name}-state"
    state.mkdir()
    script = tmp_path / name
    script.write_text(text)
    script.chmod(0o755)
    monkeypatch.setenv(variable, str(script))
    monkeypatch.setenv(state_variable, str(state))

    def calls():
        log = state / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    calls.state = state
    return calls


@pytest.fixture
def kubectl(tmp_path, monkeypatch):
    """KUBECTL -> a fake kubectl; yields a reader of its recorded calls. Kills what it started."""
    calls = fake_executable(tmp_path, monkeypatch, "kubectl", FAKE_KUBECTL, "KUBECTL", "FAKE_KUBECTL_STATE")
    monkeypatch.setenv("FAKE_KUBECTL_REPO", ROOT)
    state = calls.state
    yield calls
    pid_file = state / "supervisor.pid"
    if pid_file.exists():
        import signal

        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


FAKE_LAUNCHER = textwrap.dedent(r'''
    #!PYTHON
    # A stand-in for the Dataflow launcher (pipeline.cloud.dataflow_stages): records its calls and
    # answers each stage's states from FAKE_DATAFLOW_SCRIPT ({stage: [state at launch, at query 1, ...]}).
    # Like the real jobs it writes to OUT, through the GCS emulator's JSON API: plan the manifest
    # (FAKE_DATAFLOW_SLICES slices), generate one commit marker per RUNNING answer, collect the
    # dataset's stats.json once DONE. No Beam, no model: a few milliseconds a call.
    import hashlib, json, os, sys, urllib.parse, urllib.request

    STATE = os.environ["FAKE_DATAFLOW_STATE"]
    SCRIPT = json.loads(os.environ["FAKE_DATAFLOW_SCRIPT"])
    SLICES = int(os.environ.get("FAKE_DATAFLOW_SLICES", "2"))


    def put(url, obj):
        bucket, _, name = url.removeprefix("gs://").partition("/")
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        request = urllib.request.Request(f"{os.environ['STORAGE_EMULATOR_HOST']}/upload/storage/v1/b/{bucket}/o?"
                                         f"{query}", data=json.dumps(obj).encode(), method="POST",
                                         headers={"Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request).read()


    def answer(stage, n):
        states = SCRIPT[stage]
        state = states[min(n, len(states) - 1)]
        with open(os.path.join(STATE, stage + ".out")) as f:
            out = f.read()
        if stage == "generate" and state == "RUNNING" and n >= 1 and n - 1 < SLICES:
            spread = f"{hashlib.sha256(str(n - 1).encode()).hexdigest()[:4]}-{n - 1:05d}"  # naming.output_name
            put(f"{out}/shards/{spread}_stats.json", {"slice": n - 1})
        if stage == "collect" and state == "DONE":
            put(f"{out}/dataset/stats.json", {"images": 2 * SLICES, "records": 2 * SLICES, "rejects": 0,
                                              "verified": True})
        print(json.dumps({"job_id": f"2026-fake-{stage}", "state": state}))


    def main():
        args = sys.argv[1:]
        with open(os.path.join(STATE, "calls.jsonl"), "a") as f:
            f.write(json.dumps(args) + "\n")
        if os.environ.get("FAKE_DATAFLOW_BROKEN"):
            print("fake launcher: no credentials", file=sys.stderr)
            return 3
        if args[0] == "run":
            stage, out = args[1], args[args.index("--out") + 1]
            with open(os.path.join(STATE, stage + ".out"), "w") as f:
                f.write(out)
            if stage == "plan":
                put(f"{out}/plan/manifest.json", {"records": 2 * SLICES, "images": 2 * SLICES, "rejects": 0,
                                                  "slices": SLICES, "slice_size": 2})
                if os.environ.get("FAKE_DATAFLOW_PLAN_KEPT"):  # as the launcher answers a plan it keeps
                    print(json.dumps({"job_id": "", "state": "DONE", "plan_kept": True}))
                    return 0
            answer(stage, 0)
            return 0
        if args[0] == "state":
            stage = args[1].rsplit("-", 1)[1]
            counter = os.path.join(STATE, stage + ".queries")
            n = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
            with open(counter, "w") as f:
                f.write(str(n))
            answer(stage, n)
            return 0
        print(f"fake launcher: unsupported {args}", file=sys.stderr)
        return 2


    sys.exit(main())
''').lstrip().replace("PYTHON", sys.executable)
DONE_SCRIPT = {"plan": ["PENDING", "RUNNING", "DONE"], "generate": ["PENDING", "RUNNING", "RUNNING", "DONE"],
               "collect": ["RUNNING", "DONE"]}


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    """DATAFLOW_LAUNCHER -> a fake launcher; yields a reader of its recorded calls."""
    calls = fake_executable(tmp_path, monkeypatch, "dataflow-launcher", FAKE_LAUNCHER, "DATAFLOW_LAUNCHER",
                            "FAKE_DATAFLOW_STATE")
    monkeypatch.setenv("FAKE_DATAFLOW_SCRIPT", json.dumps(DONE_SCRIPT))
    return calls


# The TPU check (tests/test_tpu_check.py) compiles for a minute; these tests are about the rest
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


def _dataflow_job(out, **changes):
    fields = dict(settings=Settings(out=out), tpu_slice=tpu.for_dataflow("v5e", "2x4"), plan_options=("--a=1",),
                  generate_options=("--b=2",), collect_options=("--c=3",), project="p", region="r", poll_s=0.01)
    return dataflow.DataflowJob(**{**fields, **changes})


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


def _commit(out, index):
    storage.write_json(naming.shard_stats(out, index), {"slice": index})


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


# ---------------------------------------------------------------- stopped while following


def _interrupt(seconds):
    raise KeyboardInterrupt


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
