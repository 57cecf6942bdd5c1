"""The fakes the submit tests run against: a kubectl that starts a JobSet's hosts as local
processes, and a Dataflow launcher that answers from a script (fixtures ``kubectl`` and
``launcher``)."""
import json
import os
import sys
import textwrap

import pytest

from tests.conftest import ROOT

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
