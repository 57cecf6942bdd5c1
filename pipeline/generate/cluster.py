"""Joining the cluster of hosts with ``jax.distributed``.

``plan_initialize`` chooses how, in this order:
  * ``flags``: explicit --coordinator, --num-hosts and --host-id (local runs); giving only
    some of the three is an error;
  * ``tpu``: on a Cloud TPU VM (a Google TPU on the PCI bus), ``jax.distributed.initialize()``
    bare: JAX detects the slice from the TPU metadata, on TPU VMs and on GKE alike;
  * ``gke-env``: no TPU but the GKE-style variables ``TPU_WORKER_ID`` and
    ``TPU_WORKER_HOSTNAMES`` (what GKE injects into the pods of a multi-host TPU slice,
    and what promptmill's JobSet sets): host 0 of the host names is the coordinator, on
    port ``PROMPTMILL_COORDINATOR_PORT`` (default 8476);
  * ``auto``: nothing of the above: ``initialize()`` bare, whose error is explained.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time


@dataclasses.dataclass(frozen=True)
class ClusterArgs:
    coordinator: str | None = None
    num_hosts: int | None = None
    host_id: int | None = None


def initialize_kwargs(args: ClusterArgs) -> dict:
    """Arguments for ``jax.distributed.initialize`` (empty: auto-detection)."""
    given = [v is not None for v in (args.coordinator, args.num_hosts, args.host_id)]
    if not any(given):
        return {}
    if not all(given):
        raise ValueError("give all of --coordinator, --num-hosts and --host-id, or none of them "
                         "(none: detect the Cloud TPU / GKE cluster)")
    if args.num_hosts < 1 or not 0 <= args.host_id < args.num_hosts:
        raise ValueError(f"--host-id must be in [0, {args.num_hosts}), got {args.host_id}")
    return {"coordinator_address": args.coordinator, "num_processes": args.num_hosts,
            "process_id": args.host_id}


WORKER_ID, WORKER_HOSTNAMES, COORDINATOR_PORT = "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "PROMPTMILL_COORDINATOR_PORT"
DEFAULT_COORDINATOR_PORT = 8476
GOOGLE_PCI_VENDOR = "0x1ae0"  # Cloud TPU chips on a TPU VM's PCI bus


def gke_env_kwargs(env) -> dict:
    """``initialize`` arguments from the GKE-style variables in ``env``."""
    hosts = [h.strip() for h in env.get(WORKER_HOSTNAMES, "").split(",") if h.strip()]
    if not hosts:
        raise ValueError(f"{WORKER_HOSTNAMES} must list the hosts' names, comma-separated, got "
                         f"{env.get(WORKER_HOSTNAMES)!r}")
    worker, port = env.get(WORKER_ID, ""), env.get(COORDINATOR_PORT) or str(DEFAULT_COORDINATOR_PORT)
    if not worker.strip().isdigit() or int(worker) >= len(hosts):
        raise ValueError(f"{WORKER_ID} must be a host index in [0, {len(hosts)}) ({WORKER_HOSTNAMES} names "
                         f"{len(hosts)}), got {worker!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{COORDINATOR_PORT} must be a TCP port, got {port!r}")
    return {"coordinator_address": f"{hosts[0]}:{int(port)}", "num_processes": len(hosts),
            "process_id": int(worker)}


def plan_initialize(args: ClusterArgs, env, tpu_present: bool) -> tuple[str, dict]:
    """(how, ``jax.distributed.initialize`` arguments): see the module's docstring."""
    kwargs = initialize_kwargs(args)
    if kwargs:
        return "flags", kwargs
    if tpu_present:
        return "tpu", {}
    if env.get(WORKER_HOSTNAMES) or env.get(WORKER_ID):
        return "gke-env", gke_env_kwargs(env)
    return "auto", {}


def tpu_present(devices_root: str = "/sys/bus/pci/devices") -> bool:
    """Whether a Google TPU sits on this machine's PCI bus (a Cloud TPU VM)."""
    try:
        names = os.listdir(devices_root)
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(devices_root, name, "vendor")) as f:
                if f.read().strip().lower() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def initialize(args: ClusterArgs) -> tuple[int, int]:
    """Join the cluster; returns (host index, host count)."""
    import jax

    from pipeline.core import logs

    # CPU devices of several processes need a collectives backend to form one
    # cluster (the local test bed: N processes on 127.0.0.1); the setting does nothing
    # on TPU or GPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # on by default, but a host stops on SIGTERM through it (``pipeline.generate.stopping``),
    # so a JAX_ENABLE_PREEMPTION_SERVICE=false in the environment must not turn it off
    jax.config.update("jax_enable_preemption_service", True)
    how, kwargs = plan_initialize(args, os.environ, tpu_present())
    logs.event("cluster_join", how=how, **{k: v for k, v in kwargs.items() if k != "process_id"})
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:
        if kwargs:
            raise
        raise RuntimeError("could not detect a TPU cluster; for a local run pass --coordinator HOST:PORT "
                           f"--num-hosts N --host-id I, or set {WORKER_ID} and {WORKER_HOSTNAMES} ({e})") from e
    return jax.process_index(), jax.process_count()


# Hosts may finish hours apart (on resume, one can have everything committed and another
# all of its slices to do); a host that dies ends every wait sooner, through the
# coordination service's heartbeats.
BARRIER_TIMEOUT_S = 7 * 24 * 3600


def wait_for_all(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Block until every host reaches the barrier ``name`` (no-op with one host).

    This is the coordination service's barrier, not a device collective: a collective
    (``multihost_utils.sync_global_devices``) must set up its CPU communicator within
    30 s, so it fails when one host arrives much later than another.
    """
    import jax

    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client's barrier has no public wrapper

    distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


END_KEY = "promptmill/end/{host}"  # a host's outcome: "done" or "stopped"
LEFT_KEY = "promptmill/left/{host}"  # a stopped run's host, leaving now
LEAVE_TIMEOUT_S = 30.0
LEAVE_GRACE_S = 1.0  # host 0's wait, once every host said it leaves, for their processes to end


def _client():
    from jax._src import distributed  # the coordination service's key-value store has no public wrapper

    return distributed.global_state.client


STOPPED_WAIT_S = 120.0  # how long a stopped host waits for the others' outcomes


def finish(host: int, num_hosts: int, outcome: str, timeout_s: float | None = None) -> dict[int, str]:
    """Publish this host's ``outcome`` ("done": it ran all its batches, or "stopped": it
    stopped at the preemption sync point) and wait for every host's; returns them by host,
    "gone" for a host that gave none within ``timeout_s`` (default: ``BARRIER_TIMEOUT_S``
    when done, ``STOPPED_WAIT_S`` when stopped, since the others stop within a batch or two).

    Where a barrier would wait forever for a stopped host, this wait ends with the last
    host's outcome; a host that finished its batches long before learns here that the
    run stopped. (With one host, nothing to wait for.)
    """
    if num_hosts == 1:
        return {host: outcome}
    if timeout_s is None:
        timeout_s = STOPPED_WAIT_S if outcome == "stopped" else BARRIER_TIMEOUT_S
    client = _client()
    client.key_value_set(END_KEY.format(host=host), outcome)
    deadline = time.monotonic() + timeout_s
    outcomes = {}
    for h in range(num_hosts):
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            outcomes[h] = client.blocking_key_value_get(END_KEY.format(host=h), left_ms)
        except Exception:  # noqa: BLE001 - the client raises a plain XlaRuntimeError on a timeout
            outcomes[h] = "gone"
    return outcomes


def leave(host: int, num_hosts: int, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
    """The last thing a stopped host does before its process ends (``stopping.exit_now``):
    host 0, which runs the coordination service, waits until every other host has said it
    leaves (at most ``timeout_s``), then ``LEAVE_GRACE_S`` more for their processes to
    end: a host still connected to the service when it goes would be aborted by JAX
    (SIGABRT) rather than exit 143. The other hosts say it and return, to end at once."""
    if num_hosts == 1:
        return
    client = _client()
    client.key_value_set(LEFT_KEY.format(host=host), "1")
    if host == 0:
        for h in range(1, num_hosts):
            try:
                client.blocking_key_value_get(LEFT_KEY.format(host=h), int(timeout_s * 1000))
            except Exception:  # noqa: BLE001 - that host is gone or late: leave anyway
                return
        time.sleep(LEAVE_GRACE_S)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
