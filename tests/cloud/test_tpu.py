"""The TPU table: every row is consistent, the documented values hold, bad input is refused clearly."""
import math

import pytest

from pipeline.cloud import tpu

# What Google's docs say (see pipeline/cloud/tpu.py's docstring for the pages), restated here by
# hand so a typo in the table cannot pass: (type, topology, machine type) -> hosts.
DOCUMENTED_HOSTS = {
    ("v5e", "1x1", "ct5lp-hightpu-1t"): 1, ("v5e", "2x2", "ct5lp-hightpu-4t"): 1,
    ("v5e", "2x4", "ct5lp-hightpu-8t"): 1, ("v5e", "2x4", "ct5lp-hightpu-4t"): 2,
    ("v5e", "4x4", "ct5lp-hightpu-4t"): 4, ("v5e", "4x8", "ct5lp-hightpu-4t"): 8,
    ("v5e", "8x8", "ct5lp-hightpu-4t"): 16, ("v5e", "8x16", "ct5lp-hightpu-4t"): 32,
    ("v5e", "16x16", "ct5lp-hightpu-4t"): 64,
    ("v6e", "1x1", "ct6e-standard-1t"): 1, ("v6e", "2x2", "ct6e-standard-4t"): 1,
    ("v6e", "2x4", "ct6e-standard-8t"): 1, ("v6e", "2x4", "ct6e-standard-4t"): 2,
    ("v6e", "4x4", "ct6e-standard-4t"): 4, ("v6e", "4x8", "ct6e-standard-4t"): 8,
    ("v6e", "8x8", "ct6e-standard-4t"): 16, ("v6e", "8x16", "ct6e-standard-4t"): 32,
    ("v6e", "16x16", "ct6e-standard-4t"): 64,
    ("v5p", "2x2x1", "ct5p-hightpu-4t"): 1, ("v5p", "2x2x2", "ct5p-hightpu-4t"): 2,
    ("v5p", "2x2x4", "ct5p-hightpu-4t"): 4, ("v5p", "2x4x4", "ct5p-hightpu-4t"): 8,
    ("v5p", "4x4x4", "ct5p-hightpu-4t"): 16,
    # Ironwood: 4 chips per VM (GKE's Ironwood page; xpk: tpu7x-standard-4t, chips_per_vm 4, 4x4x4 on 16 VMs)
    ("tpu7x", "2x2x1", "tpu7x-standard-4t"): 1, ("tpu7x", "2x2x2", "tpu7x-standard-4t"): 2,
    ("tpu7x", "2x2x4", "tpu7x-standard-4t"): 4, ("tpu7x", "2x4x4", "tpu7x-standard-4t"): 8,
    ("tpu7x", "4x4x4", "tpu7x-standard-4t"): 16,
}
# Dataflow's TPU table: (type, topology) -> the machine type it requires.
DATAFLOW = {("v5e", "1x1"): "ct5lp-hightpu-1t", ("v5e", "2x2"): "ct5lp-hightpu-4t", ("v5e", "2x4"): "ct5lp-hightpu-8t",
            ("v6e", "1x1"): "ct6e-standard-1t", ("v6e", "2x2"): "ct6e-standard-4t", ("v6e", "2x4"): "ct6e-standard-8t"}
ACCELERATORS = {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice", "v5p": "tpu-v5p-slice", "tpu7x": "tpu7x"}
MACHINE_PREFIX = {"v5e": "ct5lp-hightpu-", "v6e": "ct6e-standard-", "v5p": "ct5p-hightpu-", "tpu7x": "tpu7x-standard-"}


def test_the_table_is_exactly_the_documented_rows():
    assert {(s.tpu_type, s.topology, s.machine_type): s.hosts for s in tpu.SLICES} == DOCUMENTED_HOSTS
    assert {(s.tpu_type, s.topology): s.machine_type for s in tpu.SLICES if s.dataflow} == DATAFLOW
    assert len(set(tpu.SLICES)) == len(tpu.SLICES)


@pytest.mark.parametrize("s", tpu.SLICES, ids=lambda s: f"{s.tpu_type}-{s.topology}-{s.machine_type}")
def test_every_row_is_consistent(s):
    dims = tpu.parse_topology(s.topology)
    assert len(dims) == tpu.TYPES[s.tpu_type].dims
    assert s.chips == math.prod(dims)
    assert s.chips_per_host == int(s.machine_type.rsplit("-", 1)[1].rstrip("t")) in (1, 4, 8)
    assert s.hosts * s.chips_per_host == s.chips  # whole hosts only
    assert s.machine_type.startswith(MACHINE_PREFIX[s.tpu_type])
    assert s.accelerator == ACCELERATORS[s.tpu_type]
    assert tpu.node_selector(s) == {"cloud.google.com/gke-tpu-accelerator": ACCELERATORS[s.tpu_type],
                                    "cloud.google.com/gke-tpu-topology": s.topology}
    if s.dataflow:  # Dataflow runs single-host workers only
        assert s.single_host
        assert tpu.worker_accelerator(s) == f"type:{ACCELERATORS[s.tpu_type]};topology:{s.topology}"
    else:
        with pytest.raises(ValueError, match="not a Dataflow worker"):
            tpu.worker_accelerator(s)


def test_a_topology_on_two_machine_types_defaults_to_the_single_host_one():
    assert tpu.lookup("v5e", "2x4") == tpu.TpuSlice("v5e", "2x4", "ct5lp-hightpu-8t", True)
    assert tpu.lookup("v6e", "2x4").machine_type == "ct6e-standard-8t"
    two = tpu.lookup("v5e", "2x4", "ct5lp-hightpu-4t")
    assert (two.hosts, two.chips_per_host, two.dataflow) == (2, 4, False)
    assert [s.machine_type for s in tpu.variants("v6e", "2x4")] == ["ct6e-standard-8t", "ct6e-standard-4t"]
    with pytest.raises(ValueError) as e:
        tpu.lookup("v5e", "2x4", "ct5lp-hightpu-1t")
    assert "does not run on --machine-type ct5lp-hightpu-1t" in str(e.value)
    assert "ct5lp-hightpu-8t, ct5lp-hightpu-4t" in str(e.value)


def test_ironwood_is_two_devices_per_chip_with_half_a_chips_hbm_each():
    s = tpu.lookup("ironwood", "2x2x1")
    assert (s.tpu_type, s.machine_type, s.chips_per_host, s.devices_per_host) == ("tpu7x", "tpu7x-standard-4t", 4, 8)
    assert (s.hbm_gib, s.device_hbm_gib) == (192.0, 96.0) and tpu.lookup("v7x", "2x2x1") == s
    assert "8 devices: 2 per chip" in s.describe()
    assert tpu.lookup("v5e", "2x2").devices_per_host == 4 and tpu.lookup("v5e", "2x2").device_hbm_gib == 16.0
    with pytest.raises(ValueError, match="Dataflow offers no tpu7x workers"):
        tpu.for_dataflow("tpu7x", "2x2x1")


def test_aliases_and_case():
    assert tpu.lookup("tpu-v5-lite-podslice", "4x4") == tpu.lookup("v5e", "4x4")
    assert tpu.lookup("V6E", " 2X2 ").topology == "2x2"
    assert tpu.tpu_type_name("tpu-v5p-slice") == "v5p"


def test_for_dataflow_picks_the_single_host_machine():
    assert tpu.for_dataflow("v5e", "2x4").machine_type == "ct5lp-hightpu-8t"
    assert tpu.for_dataflow("v6e", "1x1").machine_type == "ct6e-standard-1t"


@pytest.mark.parametrize("tpu_type,topology,hosts", [("v5e", "4x4", 4), ("v6e", "16x16", 64), ("v5e", "8x8", 16)])
def test_dataflow_refuses_multi_host_topologies_naming_the_hosts_and_the_alternatives(tpu_type, topology, hosts):
    with pytest.raises(ValueError) as e:
        tpu.for_dataflow(tpu_type, topology)
    message = str(e.value)
    assert f"--tpu-type {tpu_type} --topology {topology} cannot run on Dataflow" in message
    assert f"needs {hosts} hosts" in message and "single-host" in message
    assert "Dataflow topologies for " + tpu_type + ": 1x1, 2x2, 2x4" in message
    assert "promptmill submit gke" in message


def test_dataflow_refuses_v5p():
    with pytest.raises(ValueError) as e:
        tpu.for_dataflow("v5p", "2x2x1")
    assert "Dataflow offers no v5p workers" in str(e.value) and "v5e, v6e" in str(e.value)
    assert tpu.topologies("v5p", dataflow=True) == []


def test_unknown_type_lists_the_supported_ones():
    with pytest.raises(ValueError) as e:
        tpu.lookup("v4", "2x2x1")
    assert str(e.value).startswith("unknown --tpu-type 'v4'; supported: v5e, v6e, v5p, tpu7x")


@pytest.mark.parametrize("tpu_type,topology", [("v5e", "3x3"), ("v5e", "2x2x1"), ("v5p", "2x4"), ("v6e", "32x32")])
def test_unsupported_topology_names_type_topology_and_the_supported_list(tpu_type, topology):
    with pytest.raises(ValueError) as e:
        tpu.lookup(tpu_type, topology)
    message = str(e.value)
    assert f"--tpu-type {tpu_type} does not support --topology {topology}" in message
    assert f"supported {tpu_type} topologies: {', '.join(tpu.topologies(tpu_type))}" in message
    assert tpu.topologies("v5e") == ["1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"]


@pytest.mark.parametrize("text", ["", "2", "2x", "x2", "0x2", "2x0", "2*4", "2 x 4", "abc", "-2x2", None, 24])
def test_bad_topology_strings(text):
    with pytest.raises(ValueError, match="--topology must be chips per dimension joined by 'x'"):
        tpu.parse_topology(text)


@pytest.mark.parametrize("machine", ["n1-standard-4", "ct5lp-hightpu", "ct5lp-hightpu-0t", ""])
def test_machine_chips_refuses_non_tpu_machine_types(machine):
    with pytest.raises(ValueError, match="not a TPU machine type"):
        tpu.machine_chips(machine)
