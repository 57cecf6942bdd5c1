"""How promptmill starts a Python child process (hosts, compile children, launchers).

``python -m`` and ``python -c`` put the current folder first on ``sys.path``, so a
user's own ``jobs/`` or ``pipeline/`` folder (common names) would run, or break, in
every host. Children run with ``-P`` (Python 3.11+): the installed package, never a
module of the folder the user stands in; ``PYTHONPATH`` is honoured as given.
"""
from __future__ import annotations

import sys


def python(*args: str) -> list[str]:
    """The command line of a Python child process running ``args`` (``-m MODULE ...``,
    ``-c CODE ...``) isolated from the current folder."""
    return [sys.executable, "-P", *args]
