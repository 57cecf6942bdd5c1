import pytest

from pipeline.engines.local import host_env
from pipeline.generate import cluster


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


# Hosts that form their cluster from these variables alone, started from a rendered JobSet's
# command and env, complete a run in tests/cloud/test_submit_gke.py::test_gke_end_to_end_with_a_fake_kubectl.
