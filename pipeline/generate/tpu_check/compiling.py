"""A lowered program compiled here for the target's chips, and what the compile found:
the whole compile's figures (``compiled_figures``), or the HBM that XLA's buffer
assignment placed, the compile stopped there (``assigned_figures``); either remembered by
the program's own text (``compile_cache.figures_key``), and XLA's refusal for memory a
result too."""
from __future__ import annotations

import tempfile
import time

from pipeline.generate import compile_cache, compile_process
from pipeline.generate.tpu_check import chips
from pipeline.generate.tpu_check.errors import TpuCheckError
from pipeline.generate.tpu_check.xla_text import memory_report, out_of_memory


def _recalled(key: str) -> dict | None:
    """What was kept for the program of ``key`` (``compile_cache.figures_key``), or None;
    ``compile_process.Crashed`` again at once for one that crashed libtpu's compiler before
    (``child.note_crash``)."""
    found = compile_cache.recall(key)
    if found is not None and "crashed" in found:
        raise compile_process.Crashed(found["crashed"], True, found.get("compile_s", 0.0), "", key, remembered=True)
    return found


def compiled_figures(lowered, target: chips.Target, figures) -> dict:
    """``figures(executable)`` (a JSON-able dict) of ``lowered`` compiled for ``target``'s
    chips, or ``{"refused_temp": bytes}`` when XLA refuses it for memory (the temporaries
    of its message); either with ``compile_s``, the seconds XLA took. Remembered by the
    program's own text (``compile_cache.figures_key``), so a program compiled before for
    the same chips with the same libtpu is not compiled again, whatever else changed; one
    that crashed the compiler before raises ``compile_process.Crashed`` again at once."""
    key = compile_cache.figures_key(lowered, chips.host_devices(target))
    found = _recalled(key)
    if found is not None:
        return found
    started = time.perf_counter()
    try:
        with chips.quiet_stderr(), compile_process.compiling(key):
            executable = lowered.compile()
    except Exception as e:  # noqa: BLE001 - an out-of-memory refusal is a result; anything else is raised
        refused = out_of_memory(str(e))
        if refused is None or "temp" not in refused:
            raise
        value = {"refused_temp": refused["temp"]}
    else:
        value = figures(executable)
    value["compile_s"] = time.perf_counter() - started
    compile_cache.remember(key, value)
    return value


def assigned_figures(lowered, target: chips.Target) -> dict:
    """``{"total": bytes}`` that XLA's buffer assignment placed in one of ``target``'s
    chips' HBM for ``lowered`` (``memory_report``), or ``{"refused_temp": bytes}`` when XLA
    refuses it for memory; with ``compile_s``, the seconds it took to get there.

    Buffer assignment comes early in a TPU compile: the code generation after it takes
    the rest, 50 to 70 times as long for a VAE decode. A compiling child
    (``compile_process``) answers as soon as the report is written and is ended with the
    compile unfinished; elsewhere the compile runs to its end. The backend moves buffers
    after buffer assignment (SD 1.5's VAE decode at 512x512 on v6e measured 70 MB more in
    the whole compile, 14% of what it needs beyond its weights; a small program's
    temporaries can move into VMEM), so these figures predict and a whole compile decides
    (``search``). Remembered by the program's own text, as ``compiled_figures`` are."""
    import threading

    key = compile_cache.figures_key(lowered, chips.host_devices(target), kind="assigned")
    found = _recalled(key)
    if found is not None:
        return found
    child = compile_process.scratch()  # a child's dump goes in its parent's folder, removed after the child ends
    folder = tempfile.mkdtemp(prefix="xla-dump-", dir=child)
    ended, failed = threading.Event(), []

    def compile_it():
        try:
            lowered.compile(compiler_options={"xla_dump_to": folder})
        except Exception as e:  # noqa: BLE001 - read below
            failed.append(e)
        finally:
            ended.set()

    started = time.perf_counter()
    with chips.quiet_stderr(), compile_process.compiling(key):
        threading.Thread(target=compile_it, daemon=True).start()
        total = None
        while total is None:
            done = ended.wait(0.2)
            total = memory_report(folder, complete=done)
            if done and total is None:
                break
        seconds = time.perf_counter() - started
        if child is None:
            ended.wait()  # nothing ends this process's compile: let it finish
    if child is None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    if total is not None:
        value = {"total": total}
    else:
        refused = out_of_memory(str(failed[0])) if failed else None
        if refused is None or "temp" not in refused:
            if failed:
                raise failed[0]
            raise TpuCheckError("XLA wrote no memory-usage report for a part of a step")
        value = {"refused_temp": refused["temp"]}
    value["compile_s"] = seconds
    compile_cache.remember(key, value)
    return value
