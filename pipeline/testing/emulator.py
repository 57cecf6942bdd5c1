"""A local GCS emulator (``gcp-storage-emulator``) for tests and benchmarks.

google-cloud-storage and Beam find it through ``STORAGE_EMULATOR_HOST``; tensorstore
through ``TENSORSTORE_GCS_HTTP_URL`` and ``GOOGLE_AUTH_TOKEN_FOR_TESTING``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time

from pipeline.generate import cluster


def env_for(url: str) -> dict:
    """The variables that point every GCS client we use at ``url``."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x"}


@contextlib.contextmanager
def running(bucket: str = "promptmill-test", timeout_s: float = 30.0):
    """Start the emulator on a free 127.0.0.1 port with ``bucket`` created; yields its URL.

    The process environment points at it while the block runs and is restored after.
    """
    from pipeline.io import gcs

    exe = shutil.which("gcp-storage-emulator", path=os.path.dirname(sys.executable)) or \
        shutil.which("gcp-storage-emulator")
    if exe is None:
        raise RuntimeError("gcp-storage-emulator is not installed (pip install gcp-storage-emulator)")
    port = cluster.free_port()
    proc = subprocess.Popen([exe, "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"the GCS emulator did not start on port {port}")
            time.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    previous = {k: os.environ.get(k) for k in env_for(url)}
    os.environ.update(env_for(url))
    gcs.reset_client()
    try:
        gcs.client().create_bucket(bucket)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        gcs.reset_client()
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
