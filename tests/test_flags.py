"""The suite's XLA:CPU flags against the installed jaxlib: XLA stops a process on a flag it
does not know (a flag that a jaxlib release dropped aborts every test that starts JAX)."""
import os
import subprocess
import sys

from tests.conftest import ROOT, SUITE_XLA_FLAGS


def start_jax(flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices()))"], cwd=ROOT, env=env,
                          capture_output=True, text=True)


def test_the_suites_flags_start_jax():
    started = start_jax(SUITE_XLA_FLAGS)
    assert started.returncode == 0, started.stderr[-2000:]
    assert started.stdout.split() == ["2"]


def test_an_unknown_flag_stops_the_process():
    """What the check above guards against: XLA's own refusal, naming the flag."""
    refused = start_jax(SUITE_XLA_FLAGS + " --xla_cpu_no_such_flag=true")
    assert refused.returncode != 0 and "--xla_cpu_no_such_flag" in refused.stderr
