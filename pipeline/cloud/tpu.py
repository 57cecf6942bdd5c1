"""The TPU table (pure): which TPU slices promptmill can be submitted to, and what each needs.

A TPU slice (Google's term; not promptmill's slice of prompts) is a TPU type and a
topology, run on one machine type. From the machine type follow the chips per host
(the ``-Nt`` suffix: ``ct5lp-hightpu-4t`` has 4 chips) and so the hosts: chips of the
topology / chips per host. GKE schedules a TPU slice with two node labels,
``cloud.google.com/gke-tpu-accelerator`` and ``cloud.google.com/gke-tpu-topology``,
and each pod asks for its host's chips as ``google.com/tpu``. Dataflow runs only
single-host TPU slices, one per worker
(``worker_accelerator=type:…;topology:…``), on the one machine type its table requires.

Sources (checked while writing this table):
  * GKE and Cloud TPU, v5e: the TPU-types table of GoogleCloudPlatform/
    applied-ai-engineering-samples (saxml-on-gke README): v5litepod-1/4/8 are 1x1/2x2/2x4
    on one ct5lp-hightpu-1t/4t/8t VM; 4x4 … 16x16 are ct5lp-hightpu-4t VMs of 4 chips
    (4 … 64 VMs). Cloud TPU's v5e page: a v5e VM holds 1, 4 or 8 chips. xpk's
    system_characteristics (AI-Hypercomputer/xpk) runs 2x4 as 2 ct5lp-hightpu-4t VMs.
  * v6e: Cloud TPU's v6e page (8 chips per host at most); xpk: 1x1 on ct6e-standard-1t,
    2x2 … 16x16 on ct6e-standard-4t (4 chips per VM); 2x4 on one ct6e-standard-8t VM
    (Google's TPU VM provisioning tables list ct6e-standard-8t only for 2x4).
  * v5p: Cloud TPU's v5p page: 2x2x1 = 4 chips on 1 host, 2x2x2 = 8 on 2, 2x4x4 = 32
    on 8, 4x4x4 = 64 on 16; xpk: ct5p-hightpu-4t, tpu-v5p-slice, also 2x2x4 (16 on 4).
  * Ironwood (TPU7x): Cloud TPU's TPU7x page (cloud.google.com/tpu/docs/tpu7x): 192 GiB of
    HBM per chip, two TensorCores per chip; GKE's Ironwood page (kubernetes-engine/docs/
    concepts/tpu-ironwood): each VM holds 4 chips, GKE 1.34 and later; xpk's
    system_characteristics: gke_accelerator tpu7x, machine type tpu7x-standard-4t (4 chips
    per VM), topologies 2x2x1, 2x2x2, 2x2x4, 2x4x4 and AxBxC multiples of 4 (4x4x4 = 64
    chips on 16 VMs; xpk's device types, tpu7x-128, count TensorCores). libtpu describes a
    host of 4 chips (topology "tpu7x:2x2x1") as 8 devices, two per chip: JAX runs one
    program per TensorCore, so a host has 8 devices and each has half a chip's HBM.
  * HBM per chip: Cloud TPU's system architecture pages (cloud.google.com/tpu/docs/v5e,
    /v6e, /v5p): v5e 16 GiB, v6e 32 GiB, v5p 95 GiB. XLA lets one program use a little
    less (a v5e chip: 15.75 GiB); the TPU check (``pipeline.generate.tpu_check``) asks XLA.
  * Dataflow ("Dataflow support for TPUs", cloud.google.com/dataflow/docs/tpu/tpu-support):
    only single-host slices; tpu-v5-lite-podslice 1x1/2x2/2x4 require
    ct5lp-hightpu-1t/4t/8t, tpu-v6e-slice 1x1 requires ct6e-standard-1t, and the v6e
    rows that follow are the single-host 2x2 (ct6e-standard-4t) and 2x4
    (ct6e-standard-8t). Dataflow's TPU troubleshooting page repeats the rule: "The
    requested accelerator type tpu-v5-lite-podslice;topology:1x1 requires setting the
    worker machine type to ct5lp-hightpu-1t". v5p is not offered here on Dataflow.
"""
from __future__ import annotations

import dataclasses
import math
import re


@dataclasses.dataclass(frozen=True)
class TpuType:
    name: str  # what --tpu-type takes: v5e, v6e, v5p
    accelerator: str  # GKE's cloud.google.com/gke-tpu-accelerator and Dataflow's worker_accelerator type
    dims: int  # topology dimensions: 2 (AxB) or 3 (AxBxC)
    hbm_gib: float  # high-bandwidth memory of one chip
    devices_per_chip: int = 1  # JAX devices of one chip (TPU7x: its two TensorCores)


TYPES = {t.name: t for t in (
    TpuType("v5e", "tpu-v5-lite-podslice", 2, 16.0),
    TpuType("v6e", "tpu-v6e-slice", 2, 32.0),
    TpuType("v5p", "tpu-v5p-slice", 3, 95.0),
    TpuType("tpu7x", "tpu7x", 3, 192.0, devices_per_chip=2),
)}
# Other names people use for the same types (the accelerator labels, Cloud TPU's names).
_ALIASES = {**{t.accelerator: t.name for t in TYPES.values()}, "v5litepod": "v5e", "trillium": "v6e",
            "ironwood": "tpu7x", "v7x": "tpu7x"}

# Single-host slices on one VM that Dataflow runs, per type: (topology, machine type).
_DATAFLOW_VMS = {
    "v5e": (("1x1", "ct5lp-hightpu-1t"), ("2x2", "ct5lp-hightpu-4t"), ("2x4", "ct5lp-hightpu-8t")),
    "v6e": (("1x1", "ct6e-standard-1t"), ("2x2", "ct6e-standard-4t"), ("2x4", "ct6e-standard-8t")),
}
# Every type also runs on VMs of 4 chips (GKE only): its machine type, and the topologies it
# runs on them, by topology dimensions. A 2-D type's 2x4 is two such VMs beside its one 8-chip
# VM above; a 3-D type's 2x2x1 is one VM.
_FOUR_CHIP_VMS = {"v5e": "ct5lp-hightpu-4t", "v6e": "ct6e-standard-4t", "v5p": "ct5p-hightpu-4t",
                  "tpu7x": "tpu7x-standard-4t"}
_FOUR_CHIP_TOPOLOGIES = {2: ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
                         3: ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4")}
# (type, topology, machine type, runs on Dataflow), type by type. The first row of a (type,
# topology) is its default machine type: the one with the fewest hosts.
_ROWS = tuple(row for name, t in TYPES.items() for row in (
    *((name, topology, machine, True) for topology, machine in _DATAFLOW_VMS.get(name, ())),
    *((name, topology, _FOUR_CHIP_VMS[name], False) for topology in _FOUR_CHIP_TOPOLOGIES[t.dims])))

_TOPOLOGY = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*)+")
_MACHINE_CHIPS = re.compile(r"(?:ct[0-9a-z]+|tpu[0-9a-z]+)-[a-z]+-([1-9][0-9]*)t")


def parse_topology(text: str) -> tuple[int, ...]:
    """``"2x4"`` -> ``(2, 4)``; a ValueError for anything that is not positive integers joined by 'x'."""
    if not isinstance(text, str) or not _TOPOLOGY.fullmatch(text.strip().lower()):
        raise ValueError(f"--topology must be chips per dimension joined by 'x', e.g. 2x4 or 2x2x1, got {text!r}")
    return tuple(int(part) for part in text.strip().lower().split("x"))


def machine_chips(machine_type: str) -> int:
    """Chips of one VM of a TPU machine type: ``ct5lp-hightpu-8t`` -> 8."""
    found = _MACHINE_CHIPS.fullmatch(machine_type)
    if not found:
        raise ValueError(f"not a TPU machine type (ctNN-KIND-Nt): {machine_type!r}")
    return int(found.group(1))


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """One supported TPU slice: a TPU type and topology on one machine type (Google's
    "slice", not a slice of prompts)."""
    tpu_type: str
    topology: str
    machine_type: str
    dataflow: bool  # Dataflow runs it (single host, in Dataflow's table)

    @property
    def accelerator(self) -> str:
        return TYPES[self.tpu_type].accelerator

    @property
    def chips(self) -> int:
        return math.prod(parse_topology(self.topology))

    @property
    def chips_per_host(self) -> int:
        return machine_chips(self.machine_type)

    @property
    def devices_per_host(self) -> int:
        """JAX devices of one host (``--devices-per-host``): its chips, or their TensorCores
        where a chip is two devices (TPU7x)."""
        return self.chips_per_host * TYPES[self.tpu_type].devices_per_chip

    @property
    def device_hbm_gib(self) -> float:
        """HBM of one JAX device: a chip's, or its share of it."""
        return self.hbm_gib / TYPES[self.tpu_type].devices_per_chip

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def single_host(self) -> bool:
        return self.hosts == 1

    @property
    def hbm_gib(self) -> float:
        return TYPES[self.tpu_type].hbm_gib

    def describe(self) -> str:
        per_chip = TYPES[self.tpu_type].devices_per_chip
        devices = f" ({self.devices_per_host} devices: {per_chip} per chip)" if per_chip > 1 else ""
        return (f"{self.tpu_type} {self.topology} on {self.machine_type}: {self.chips} chips, "
                f"{self.hosts} host(s) x {self.chips_per_host} chips{devices}")


SLICES = tuple(TpuSlice(*row) for row in _ROWS)


def tpu_type_name(text: str) -> str:
    """The table's name of a TPU type (``v5e``), from it or an alias (``tpu-v5-lite-podslice``)."""
    name = (text or "").strip().lower()
    name = _ALIASES.get(name, name)
    if name not in TYPES:
        raise ValueError(f"unknown --tpu-type {text!r}; supported: {', '.join(TYPES)} "
                         f"(or {', '.join(t.accelerator for t in TYPES.values())})")
    return name


def topologies(tpu_type: str, dataflow: bool = False) -> list[str]:
    """The supported topologies of a type, in table order (only Dataflow's with ``dataflow``)."""
    name = tpu_type_name(tpu_type)
    found: list[str] = []
    for s in SLICES:
        if s.tpu_type == name and (s.dataflow or not dataflow) and s.topology not in found:
            found.append(s.topology)
    return found


def variants(tpu_type: str, topology: str) -> list[TpuSlice]:
    """Every machine type a supported (type, topology) runs on, the default first.

    Raises ValueError naming the type and topology and listing the supported topologies.
    """
    name = tpu_type_name(tpu_type)
    dims = parse_topology(topology)
    canonical = "x".join(str(d) for d in dims)
    found = [s for s in SLICES if s.tpu_type == name and s.topology == canonical]
    if not found:
        shape = "AxB" if TYPES[name].dims == 2 else "AxBxC"
        raise ValueError(f"--tpu-type {name} does not support --topology {topology} ({name} topologies are {shape}); "
                         f"supported {name} topologies: {', '.join(topologies(name))}")
    return found


def lookup(tpu_type: str, topology: str, machine_type: str | None = None) -> TpuSlice:
    """The TPU slice for a type and topology, on ``machine_type`` or else the default (fewest hosts)."""
    found = variants(tpu_type, topology)
    if machine_type is None:
        return found[0]
    for s in found:
        if s.machine_type == machine_type:
            return s
    raise ValueError(f"{found[0].tpu_type} {found[0].topology} does not run on --machine-type {machine_type}; "
                     f"it runs on: {', '.join(s.machine_type for s in found)}")


def for_dataflow(tpu_type: str, topology: str) -> TpuSlice:
    """The Dataflow worker for a type and topology; a ValueError for what Dataflow cannot run."""
    found = variants(tpu_type, topology)
    for s in found:
        if s.dataflow:
            return s
    name = found[0].tpu_type
    supported = topologies(name, dataflow=True)
    fewest = min(found, key=lambda s: s.hosts)
    why = (f"it needs {fewest.hosts} hosts and Dataflow supports only single-host TPU workers"
           if not fewest.single_host else "Dataflow's TPU table does not list it")
    hint = (f"Dataflow topologies for {name}: {', '.join(supported)}" if supported
            else f"Dataflow offers no {name} workers (Dataflow types: "
                 f"{', '.join(t for t in TYPES if topologies(t, dataflow=True))})")
    raise ValueError(f"--tpu-type {name} --topology {found[0].topology} cannot run on Dataflow: {why}; {hint}; "
                     "run it with `promptmill submit gke` instead")


def worker_accelerator(s: TpuSlice) -> str:
    """Dataflow's worker_accelerator service option value: ``type:TYPE;topology:TOPO``."""
    if not s.dataflow:
        raise ValueError(f"{s.describe()} is not a Dataflow worker")
    return f"type:{s.accelerator};topology:{s.topology}"


def node_selector(s: TpuSlice) -> dict[str, str]:
    """The GKE node labels that place a pod on this TPU slice's node pool."""
    return {"cloud.google.com/gke-tpu-accelerator": s.accelerator, "cloud.google.com/gke-tpu-topology": s.topology}
