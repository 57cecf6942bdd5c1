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
