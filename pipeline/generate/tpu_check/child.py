"""The check's compiles in a process of their own (``compile_process``): a program that
crashes libtpu's compiler is then a result, one that does not compile, and the checking
process lives to say so; a crash of the compiler's own is remembered by the program's
text, one of the machine's (killed, out of memory) is an error."""
from __future__ import annotations

from pipeline.core import logs
from pipeline.generate import compile_cache, compile_process
from pipeline.generate.tpu_check.errors import TpuCheckError
from pipeline.generate.tpu_check.messages import describe_settings


def compiled(call, *args):
    """``call(*args)`` (a function of the check that compiles: one of
    ``compile_process.CALLS``) in a process of its own, so that a compiler crash is a
    result, not the end of the check: ``compile_process.Crashed``."""
    try:
        return compile_process.run(f"{call.__module__}:{call.__name__}", *args)
    except compile_process.Crashed:
        raise
    except compile_process.Failed as e:
        raise TpuCheckError(f"the TPU check could not compile: {e}") from None


def note_crash(e: compile_process.Crashed, context, per_device_batch: int, what: str) -> None:
    """Log a compile of ``context``'s run that crashed; TpuCheckError when it was not the
    compiler's own crash (the process was killed from outside or ran out of this machine's
    memory), which says nothing about the program and is not remembered."""
    target = context.target
    logs.event("tpu_compile_crashed", level=30, what=what, tpu_type=target.tpu_type, per_device_batch=per_device_batch,
               signal=e.signal_name, compiler=e.compiler, seconds=round(e.seconds, 1), printed=e.printed[-2000:],
               remembered=e.remembered)
    if e.compiler and e.program and not e.remembered:  # by the program's text: it holds across code changes
        compile_cache.remember(e.program, {"crashed": e.signal_name, "compile_s": e.seconds})
    if not e.compiler:
        raise TpuCheckError(f"the TPU check's compile of {what} of {describe_settings(context.settings)} at "
                            f"{per_device_batch} image(s) per {target.tpu_type} chip was stopped: {e} (out of memory "
                            f"on this machine? run it again, or on a machine with more memory)") from None
