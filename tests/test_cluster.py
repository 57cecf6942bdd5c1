import os

import pytest

from pipeline import cluster
from pipeline.launcher import host_env


def test_no_flags_means_auto_detection():
    assert cluster.initialize_kwargs(cluster.ClusterArgs()) == {}


def test_explicit_flags_are_passed_through():
    kwargs = cluster.initialize_kwargs(cluster.ClusterArgs("127.0.0.1:1234", 4, 3))
    assert kwargs == {"coordinator_address": "127.0.0.1:1234", "num_processes": 4, "process_id": 3}


@pytest.mark.parametrize("args", [cluster.ClusterArgs("h:1", None, None), cluster.ClusterArgs(None, 2, 0),
                                  cluster.ClusterArgs("h:1", 2, None)])
def test_partial_flags_are_an_error(args):
    with pytest.raises(ValueError, match="all of --coordinator"):
        cluster.initialize_kwargs(args)


def test_host_id_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="host-id"):
        cluster.initialize_kwargs(cluster.ClusterArgs("h:1", 2, 2))


def test_host_env_sets_cpu_devices_and_keeps_other_xla_flags():
    env = host_env(3, {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8", "PATH": "/bin"})
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=3"
    assert env["JAX_PLATFORMS"] == "cpu" and env["PATH"] == "/bin"


GKE = {"TPU_WORKER_ID": "2", "TPU_WORKER_HOSTNAMES": "js-w-0-0.js,js-w-0-1.js,js-w-0-2.js,js-w-0-3.js"}


def test_explicit_flags_win_over_tpu_and_gke_env():
    how, kwargs = cluster.plan_initialize(cluster.ClusterArgs("127.0.0.1:9", 2, 1), GKE, tpu_present=True)
    assert how == "flags" and kwargs["coordinator_address"] == "127.0.0.1:9"


def test_on_a_tpu_vm_jax_detects_the_slice_itself():
    assert cluster.plan_initialize(cluster.ClusterArgs(), GKE, tpu_present=True) == ("tpu", {})


def test_without_a_tpu_the_gke_variables_form_the_cluster():
    how, kwargs = cluster.plan_initialize(cluster.ClusterArgs(), GKE, tpu_present=False)
    assert how == "gke-env"
    assert kwargs == {"coordinator_address": "js-w-0-0.js:8476", "num_processes": 4, "process_id": 2}
    env = {**GKE, "PROMPTMILL_COORDINATOR_PORT": "1234", "TPU_WORKER_HOSTNAMES": " a , b ,c,d "}
    assert cluster.plan_initialize(cluster.ClusterArgs(), env, False)[1]["coordinator_address"] == "a:1234"


def test_nothing_given_means_bare_auto_detection():
    assert cluster.plan_initialize(cluster.ClusterArgs(), {"HOME": "/root"}, tpu_present=False) == ("auto", {})


@pytest.mark.parametrize("env,message", [
    ({"TPU_WORKER_ID": "0"}, "TPU_WORKER_HOSTNAMES must list"),
    ({"TPU_WORKER_ID": "4", "TPU_WORKER_HOSTNAMES": GKE["TPU_WORKER_HOSTNAMES"]}, r"host index in \[0, 4\)"),
    ({"TPU_WORKER_ID": "x", "TPU_WORKER_HOSTNAMES": "a"}, "TPU_WORKER_ID must be"),
    ({**GKE, "PROMPTMILL_COORDINATOR_PORT": "99999"}, "must be a TCP port"),
])
def test_bad_gke_variables_are_named(env, message):
    with pytest.raises(ValueError, match=message):
        cluster.plan_initialize(cluster.ClusterArgs(), env, tpu_present=False)


def test_a_tpu_is_found_by_its_pci_vendor(tmp_path):
    for name, vendor in (("0000:00:04.0", "0x1af4"), ("0000:00:05.0", "0x1ae0")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
    assert cluster.tpu_present(str(tmp_path))
    (tmp_path / "0000:00:05.0" / "vendor").write_text("0x8086\n")
    assert not cluster.tpu_present(str(tmp_path)) and not cluster.tpu_present(str(tmp_path / "absent"))


def test_generate_hosts_started_with_only_gke_variables_form_a_cluster_and_finish_a_run(tmp_path, model_cache):
    """Like the pods of the GKE JobSet: ``promptmill generate --out OUT`` and nothing
    else on the command line; the cluster comes from TPU_WORKER_ID, TPU_WORKER_HOSTNAMES
    and PROMPTMILL_COORDINATOR_PORT."""
    import json
    import subprocess
    import sys

    from pipeline import naming, storage
    from tests.conftest import ROOT, run_cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{n}", "prompt": f"a red bicycle {n}"}) + "\n" for n in range(5)))
    out = str(tmp_path / "out")
    planned = run_cli(["plan", "--prompts", str(prompts), "--out", out, "--model", "tiny", "--steps", "2",
                       "--devices-per-host", "1"], model_cache)
    assert planned.returncode == 0, planned.stderr[-3000:]
    port = cluster.free_port()
    hosts = []
    for worker in range(2):
        env = host_env(1, {**os.environ, "PROMPTMILL_CACHE": model_cache, "TPU_WORKER_ID": str(worker),
                           "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1", "PROMPTMILL_COORDINATOR_PORT": str(port)})
        hosts.append(subprocess.Popen([sys.executable, "-m", "jobs.cli", "generate", "--out", out], env=env,
                                      cwd=ROOT, stderr=subprocess.PIPE, text=True))
    errors = [host.communicate(timeout=300)[1] for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    joins = [json.loads(line) for text in errors for line in text.splitlines() if '"cluster_join"' in line]
    assert [(j["how"], j["num_processes"]) for j in joins] == [("gke-env", 2), ("gke-env", 2)]
    committed = {storage.read_json(p)["host"] for p in storage.glob(naming.join(out, "shards", "*_stats.json"))}
    assert committed == {0, 1}  # both hosts did their share of the 3 slices
    collected = run_cli(["collect", "--out", out], model_cache)
    assert collected.returncode == 0, collected.stderr[-3000:]
    assert storage.read_json(naming.dataset_file(out, "stats.json"))["images"] == 5
