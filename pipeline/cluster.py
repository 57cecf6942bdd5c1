"""Joining the cluster of hosts with ``jax.distributed``.

Three cases, chosen by ``cluster_args``:
  * explicit flags (local runs): coordinator address, host count and host id;
  * nothing given: ``jax.distributed.initialize()`` with no arguments, which detects
    Cloud TPU and GKE TPU slices by itself.
Giving only some of the three flags is an error.
"""
from __future__ import annotations

import dataclasses
import socket


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


def initialize(args: ClusterArgs) -> tuple[int, int]:
    """Join the cluster; returns (host index, host count)."""
    import jax

    # CPU devices of several processes need a collectives backend to form one
    # cluster (DESIGN.md, "Local test bed"); the setting does nothing on TPU or GPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = initialize_kwargs(args)
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:
        if kwargs:
            raise
        raise RuntimeError("could not detect a TPU cluster; for a local run pass "
                           f"--coordinator HOST:PORT --num-hosts N --host-id I ({e})") from e
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
