import os
import sys

import pytest

# Tests that build a Generator in-process use two CPU devices; the flag must be set
# before JAX starts its CPU backend (host processes get theirs from the launcher).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One cache folder for the whole session, so the tiny model is built once."""
    path = str(tmp_path_factory.mktemp("promptmill-cache"))
    os.environ["PROMPTMILL_CACHE"] = path
    return path


def run_cli(args, cache, timeout=600, env=None):
    """Run ``python -m jobs.cli ARGS`` in a subprocess; returns CompletedProcess."""
    import subprocess

    full_env = dict(os.environ if env is None else env, PROMPTMILL_CACHE=cache)
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def gcs_emulator():
    """A GCS emulator on a free 127.0.0.1 port, with every GCS client pointed at it.

    Yields the name of a fresh bucket. (The emulator does not enforce preconditions,
    so no test relies on them.)
    """
    from pipeline.testing import emulator

    with emulator.running("promptmill-test"):
        yield "promptmill-test"
