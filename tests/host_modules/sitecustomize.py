"""Imported at start-up by every Python process the suite's ``run_cli`` starts (it puts this
folder on ``PYTHONPATH``): with ``PROMPTMILL_TEST_MODULES`` set, each process writes there
its command line and then each top-level package as it is first imported, so that a test
can check what a host needed (``conftest.run_cli``'s ``host_modules``). Written as they
happen, not at exit: promptmill's processes end with ``os._exit`` once their own exit
handlers ran (``jobs.cli.entry``)."""
import json
import os
import sys

_FOLDER = os.environ.get("PROMPTMILL_TEST_MODULES")
_SEEN = set()


def _on_event(event, args):
    if event != "import":
        return
    top = args[0].split(".")[0]
    if top not in _SEEN:
        _SEEN.add(top)
        with open(os.path.join(_FOLDER, f"{os.getpid()}.txt"), "a", encoding="utf-8") as f:
            f.write(top + "\n")


if _FOLDER:
    with open(os.path.join(_FOLDER, f"{os.getpid()}.txt"), "w", encoding="utf-8") as f:
        f.write(json.dumps(sys.argv) + "\n")  # at start-up: ["-m", "generate", ...] for a host
    sys.addaudithook(_on_event)
