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
    """A GCS emulator on a free 127.0.0.1 port, with google-cloud-storage pointed at it.

    Yields the name of a fresh bucket. (The emulator does not enforce preconditions,
    so no test relies on them.)
    """
    import socket
    import subprocess
    import time

    from pipeline import cluster, storage

    port = cluster.free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    proc = subprocess.Popen([exe, "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the GCS emulator did not start")
            time.sleep(0.1)
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    storage._gcs_client.cache_clear()
    storage._gcs_client().create_bucket("promptmill-test")
    try:
        yield "promptmill-test"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        storage._gcs_client.cache_clear()
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
