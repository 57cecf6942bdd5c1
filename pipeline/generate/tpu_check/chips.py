"""The target of a TPU check: one host's chips of a TPU slice (``Target``), libtpu, which
describes them without a TPU (``host_devices``: compile-only devices), and how much of a
chip's HBM one program may take (``capacity``)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from importlib import metadata

from pipeline.generate import compile_process, fit
from pipeline.generate.tpu_check.errors import TpuCheckError
from pipeline.generate.tpu_check.xla_text import out_of_memory

GIB = fit.GIB
INSTALL_HINT = ('install the TPU compiler with pip install "promptmill[tpu]" (it brings libtpu, the version '
                'jax[tpu] pins), or pass --no-tpu-check to submit without the check')


@dataclasses.dataclass(frozen=True)
class Target:
    """The chips of one host of a TPU slice: ``tpu_type`` (v5e, v6e, v5p, tpu7x), the host's
    ``chips``, and each device's HBM in GiB as the TPU table lists it (a chip's, or its
    share where a chip is several devices)."""
    tpu_type: str
    chips: int
    hbm_gib: float
    topology: str = ""  # the whole slice's, for reports
    machine_type: str = ""
    usable_gib: float | None = None  # what one program may use; None: what XLA reports for the device
    dims: int = 2  # the type's topology dimensions (the TPU table's): 3 names a host AxBxC
    devices_per_chip: int = 1  # JAX devices of one chip (TPU7x: 2)

    @property
    def host_topology(self) -> tuple[str, tuple[int, int, int]]:
        """(libtpu's topology name, chips per host bounds) of one host's chips."""
        shapes = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
        if self.chips not in shapes:
            raise TpuCheckError(f"a TPU host of {self.chips} chips is not one the check knows (1, 4 or 8)")
        bounds = shapes[self.chips]
        dims = bounds if self.dims == 3 or self.tpu_type == "v5p" else bounds[:2]
        return f"{self.tpu_type}:{'x'.join(map(str, dims))}", bounds


def libtpu_version() -> str | None:
    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None


def require_libtpu() -> str:
    version = libtpu_version()
    if version is None:
        raise TpuCheckError(f"the TPU check needs libtpu, which is not installed: {INSTALL_HINT}")
    return version


@contextlib.contextmanager
def quiet_stderr():
    """Hold back what libtpu prints on the process's stderr while it loads without a TPU
    (no TPU_ACCELERATOR_TYPE, no TPU_WORKER_HOSTNAMES: warnings about the machine it is
    not running on); yields a function returning the text, for an error message. In a
    compiling child (``compile_process``) it is held in the file its parent named, which
    the parent reads if the compiler crashes."""
    saved = os.dup(2)
    named = os.environ.get(compile_process.HELD)
    with (open(named, "w+b") if named else tempfile.TemporaryFile(mode="w+b")) as held:
        os.dup2(held.fileno(), 2)
        try:
            yield lambda: (held.seek(0), held.read().decode("utf-8", "replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


_DEVICES: dict[tuple, list] = {}


def host_devices(target: Target) -> list:
    """The chips of one host of ``target``: compile-only TPU devices (no TPU needed)."""
    name, bounds = target.host_topology
    if (name, bounds) not in _DEVICES:
        require_libtpu()
        # libtpu takes a machine-wide lock file so that two processes never drive one TPU;
        # compiling for described chips drives none, and two checks (two submissions, or a
        # test suite's workers) may well run at once
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from jax.experimental import topologies

        with quiet_stderr() as held:
            try:
                topology = topologies.get_topology_desc(platform="tpu", topology_name=name,
                                                        chips_per_host_bounds=bounds)
            except Exception as e:  # noqa: BLE001 - libtpu's reasons, with what it printed
                raise TpuCheckError(f"libtpu cannot describe {name} ({type(e).__name__}: {e}) {held()[-500:]}") \
                    from None
        _DEVICES[(name, bounds)] = [d for d in topology.devices if d.process_index == 0]
    return _DEVICES[(name, bounds)]


_AVAILABLE: dict[str, int] = {}


def available_hbm(device) -> int | None:
    """The HBM XLA lets one program of this chip kind use, in bytes (a v5e chip: 15.75 GiB
    of its 16), read from the compiler's refusal of a program far too large; None if it
    says no figure. Probed once per chip kind (a compile of well under a second)."""
    kind = device.device_kind
    if kind not in _AVAILABLE:
        import jax
        import jax.numpy as jnp

        single = jax.sharding.SingleDeviceSharding(device)
        # a sort keeps the whole 64 GiB product alive: XLA cannot tile it away
        program = jax.jit(lambda x: jnp.sort(x @ x.T, axis=0)[:8])
        try:
            program.lower(jax.ShapeDtypeStruct((2 ** 17, 128), jnp.float32, sharding=single)).compile()
            _AVAILABLE[kind] = None
        except Exception as e:  # noqa: BLE001 - the refusal is the answer
            _AVAILABLE[kind] = (out_of_memory(str(e)) or {}).get("available")
    return _AVAILABLE[kind]


def capacity(target: Target) -> tuple[int, int]:
    """(bytes a program may take on one of ``target``'s chips, the chip's usable HBM):
    ``fit.HEADROOM`` of what XLA reports available, or of the table's HBM without a report."""
    if target.usable_gib is not None:
        return int(target.usable_gib * GIB * fit.HEADROOM), int(target.usable_gib * GIB)
    reported = available_hbm(host_devices(target)[0])
    usable = reported if reported else int(target.hbm_gib * GIB)
    return int(usable * fit.HEADROOM), usable
