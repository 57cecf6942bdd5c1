"""The TPU check's compiles, each in a Python process of its own.

libtpu's compiler can crash on a program (a segmentation fault, an aborted internal
check) instead of refusing it with an error. In the submitting process that would end
``submit`` there and then, with nothing said. So the check compiles in a child: ``run``
calls one of the check's compiling functions in a fresh interpreter and returns what
it returned, and a child that dies of a signal raises ``Crashed``: which signal, whether
it is the compiler's own crash (``compiler``: the same program would crash a TPU host's
compile too, so the check may remember it) or the machine's (killed from outside, out of
memory), how long it ran, and the end of what libtpu printed.

The child finds what was compiled before (the compile cache's folder, by the program's
text) as the parent would, and keeps what it compiles there. Before each compile it
notes which program it is on (``compiling``), so a crash names the program (``Crashed.
program``) and the check can remember the crash by the program's own text, as it
remembers figures.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time

from pipeline.core import children
from pipeline.generate import compile_cache

COMMAND = children.python("-c", "import sys; from pipeline.generate import compile_process as c; "
                                 "sys.exit(c.main(sys.argv[1:]))")  # this module by its name: its errors unpickle
HELD = "PROMPTMILL_HELD_STDERR"  # where the child keeps what libtpu prints (tpu_check.chips.quiet_stderr)
NOTE = "PROMPTMILL_COMPILING"  # where the child notes the program it is compiling (``compiling``)
SCRATCH = "PROMPTMILL_COMPILE_SCRATCH"  # a folder of the parent's for the child's files, removed after it ends
COMPILER_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})
CALLS = ("pipeline.generate.tpu_check.program:compile_program",  # what a child runs: each given the check's
         "pipeline.generate.tpu_check.step_parts:assigned_part",  # Context (tpu_check.context), which pickles
         "pipeline.generate.tpu_check.program:compile_scorer_program")


class Failed(RuntimeError):
    """A compiling child ended without an answer (and not of a signal)."""


class Crashed(Failed):
    """A child compiling for the check died of a signal."""

    def __init__(self, signal_name: str, compiler: bool, seconds: float, printed: str, program: str | None = None,
                 remembered: bool = False):
        self.signal_name, self.compiler, self.seconds, self.printed = signal_name, compiler, seconds, printed
        self.program, self.remembered = program, remembered  # the program's key; a crash found in the cache
        said = f"; it printed: {printed.strip()[-400:]}" if printed.strip() else ""
        super().__init__(f"the compiling process died of {signal_name} after {seconds:.0f} s{said}"
                         f"{' (an earlier compile of the same program)' if remembered else ''}")

    def __reduce__(self):  # handed from a child to its parent whole
        return type(self), (self.signal_name, self.compiler, self.seconds, self.printed, self.program,
                             self.remembered)


@contextlib.contextmanager
def compiling(key: str):
    """Note, for the parent, that this child is compiling the program of ``key`` (the
    compile cache's figures key) until the block ends; nothing outside a child."""
    path = os.environ.get(NOTE)
    if path:
        with open(path, "w") as f:
            f.write(key)
    try:
        yield
    finally:
        if path and os.path.exists(path):
            os.remove(path)


def scratch() -> str | None:
    """In a compiling child, a folder for its files that its parent removes once the child
    has ended (a compile the child leaves unfinished may still be writing to it); None
    elsewhere."""
    return os.environ.get(SCRATCH)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _load_private(path: str):
    """Unpickle ``path``, a request or answer this process tree wrote itself into the
    ``TemporaryDirectory`` of ``run`` (0700, ours): refused in a folder another user owns
    or may write, where someone else could have put code to run."""
    folder = os.stat(os.path.dirname(os.path.abspath(path)))
    if folder.st_uid != os.getuid() or folder.st_mode & 0o077:
        raise Failed(f"{path}: not in a private folder of this user; a compiling child's files are never read "
                     f"from anywhere else")
    with open(path, "rb") as f:
        return pickle.load(f)


def run(call: str, *args):
    """``call(*args)`` (``module:function``, one of ``CALLS``) in a child process; its
    result, or the exception it raised, raised again here (``Failed`` for one not of
    promptmill's own); ``Crashed`` when the child died of a signal."""
    if call not in CALLS:
        raise ValueError(f"a compiling child runs one of {', '.join(CALLS)}, not {call!r}")
    with tempfile.TemporaryDirectory(prefix="promptmill-compile-") as folder:
        request, answer, held, note = (os.path.join(folder, name)
                                       for name in ("request", "answer", "stderr", "compiling"))
        with open(request, "wb") as f:
            pickle.dump((call, args), f)
        env = {**os.environ, HELD: held, NOTE: note, SCRATCH: folder,
               compile_cache.CHECKS_FOLDER: compile_cache.checks_folder()}
        env.setdefault("JAX_PLATFORMS", "cpu")  # compile-only TPU devices need no accelerator here
        started = time.perf_counter()
        process = subprocess.run([*COMMAND, request, answer], env=env)
        seconds = time.perf_counter() - started
        if process.returncode < 0 and not os.path.exists(answer):  # a child that answered, then died, answered
            number = -process.returncode
            printed, program = _read(held), _read(note).strip() or None
            raise Crashed(_signal_name(number), number in COMPILER_SIGNALS, seconds, printed, program)
        if not os.path.exists(answer):
            raise Failed(f"the compiling process exited with {process.returncode} and no answer")
        ok, value = _load_private(answer)
    if not ok:
        raise value
    return value


def main(argv: list[str]) -> int:
    request, answer = argv
    call, args = _load_private(request)
    module, name = call.split(":")
    try:
        result = (True, getattr(importlib.import_module(module), name)(*args))
    except Exception as e:  # noqa: BLE001 - handed to the parent, the compiler's own errors as text
        ours = type(e).__module__.startswith("pipeline.") or isinstance(e, ValueError)
        result = (False, e if ours else Failed(f"libtpu could not compile the program ({type(e).__name__}: {e})"))
    try:
        data = pickle.dumps(result)
    except Exception:  # noqa: BLE001 - an error that does not pickle, as text
        data = pickle.dumps((False, Failed(f"{type(result[1]).__name__}: {result[1]}")))
    with open(answer + ".part", "wb") as f:
        f.write(data)
    os.replace(answer + ".part", answer)  # whole, or not there
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # now: a compile left unfinished (``tpu_check.compiling.assigned_figures``) must not hold the exit

