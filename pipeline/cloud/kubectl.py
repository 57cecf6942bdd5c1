"""kubectl, and what it says about a JobSet: the one place ``submit gke`` runs a subprocess.

``KUBECTL`` overrides the kubectl on PATH (the tests point it at a fake).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess

KUBECTL_TIMEOUT_S = 300


def kubectl_base(namespace: str, kubectl: str = "kubectl") -> list[str]:
    return [kubectl, "--namespace", namespace]


def find_kubectl() -> str:
    """``KUBECTL``, or ``kubectl`` on PATH; a clear error when there is none."""
    override = os.environ.get("KUBECTL")
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise RuntimeError(f"KUBECTL={override!r} is not an executable file")
        return override
    found = shutil.which("kubectl")
    if not found:
        raise RuntimeError("kubectl was not found on PATH: install it (e.g. `gcloud components install kubectl`), "
                           "point it at the cluster (`gcloud container clusters get-credentials CLUSTER`), "
                           "or set KUBECTL=/path/to/kubectl")
    return found


class Kubectl:
    """Runs kubectl in one namespace; a failed call is a RuntimeError with its stderr."""

    def __init__(self, namespace: str, path: str | None = None):
        self.base = kubectl_base(namespace, path or find_kubectl())

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        command = [*self.base, *args]
        try:
            done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`{shlex.join(command)}` did not finish in {KUBECTL_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise RuntimeError(f"`{shlex.join(command)}` failed (exit code {done.returncode}): "
                               f"{done.stderr.strip()[-2000:]}")
        return done.stdout

    def get_jobset(self, name: str) -> dict | None:
        text = self("get", "jobset", name, "-o", "json", "--ignore-not-found")
        return json.loads(text) if text.strip() else None


def jobset_state(obj: dict | None) -> tuple[str, str]:
    """(``absent`` | ``running`` | ``completed`` | ``failed``, message) from ``kubectl get jobset -o json``."""
    if not obj:
        return "absent", "no such JobSet"
    status = obj.get("status") or {}
    for condition in status.get("conditions") or []:
        if str(condition.get("status")).lower() != "true":
            continue
        text = "; ".join(str(condition[k]) for k in ("reason", "message") if condition.get(k))
        if condition.get("type") == "Failed":
            return "failed", text or "Failed"
        if condition.get("type") == "Completed":
            return "completed", text or "Completed"
    terminal = status.get("terminalState")
    if terminal in ("Completed", "Failed"):
        return terminal.lower(), terminal
    return "running", f"restarts: {status.get('restarts', 0)}"
