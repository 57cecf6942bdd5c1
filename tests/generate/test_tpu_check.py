"""The TPU check: real TPU programs compiled here, without a TPU (libtpu's deviceless
compile), for the hosts of the TPU table; what fits, what is refused, and what
``--per-device-batch auto`` resolves to.

The compiles use the tiny models at the smallest sizes that still show what they test (a
minute each on 2 cores): 128x128 for the Pallas attention kernel (4096-token calls), 32x32
otherwise. Results are kept in the session's compile cache, so a program is compiled once.
"""
import json
import math
import os
import shutil

import pytest

from jobs import cli
from pipeline.cloud import program_check, tpu
from pipeline.core import slicing
from pipeline.core.settings import AUTO, Settings
from pipeline.generate import fit, tpu_check
from tests.conftest import ROOT

GIB = 2 ** 30


# ---------------------------------------------------------------- pure parts

@pytest.mark.parametrize("message,expected", [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (8.07T) exceeds "
     "available HBM (15.75G).", {"temp": int(8.07 * 2 ** 40), "available": int(15.75 * GIB)}),
    ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. ... required for HLO temporaries (512.5M) exceeds "
     "available HBM (31.25G)", {"temp": int(512.5 * 2 ** 20), "available": int(31.25 * GIB)}),
    ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in memory "
     "space hbm. Used 15.75G of 15.75G hbm. Exceeded hbm capacity by 6.05M.\n\nTotal hbm usage >= 15.90G:\n    "
     "reserved        258.00M \n    program           9.26G \n    arguments         6.39G \n\nOutput size 105.00M; "
     "shares 0B with arguments.\n\nProgram hbm requirement 9.26G:\n    global            99.0K\n    HLO temp"
     "          9.12G (84.6% utilization)", {"temp": int(9.26 * GIB), "available": int(15.75 * GIB)}),
    ("INVALID_ARGUMENT: something else", None),
])
def test_xla_out_of_memory_messages_are_read(message, expected):
    assert tpu_check.out_of_memory(message) == expected


@pytest.mark.parametrize("s,name,bounds", [
    (tpu.lookup("v5e", "1x1"), "v5e:1x1", (1, 1, 1)),
    (tpu.lookup("v5e", "2x4"), "v5e:2x4", (2, 4, 1)),  # one 8-chip host
    (tpu.lookup("v5e", "2x4", "ct5lp-hightpu-4t"), "v5e:2x2", (2, 2, 1)),  # two 4-chip hosts: one host's chips
    (tpu.lookup("v6e", "16x16"), "v6e:2x2", (2, 2, 1)),
    (tpu.lookup("v5p", "4x4x4"), "v5p:2x2x1", (2, 2, 1)),
])
def test_the_check_compiles_for_one_hosts_chips(s, name, bounds):
    target = program_check.target(s)
    assert target.host_topology == (name, bounds)
    assert target.hbm_gib == {"v5e": 16, "v6e": 32, "v5p": 95}[s.tpu_type]


@pytest.mark.parametrize("images,hosts,devices,most", [(43, 2, 2, 11), (44, 2, 2, 11), (45, 2, 2, 12), (1, 4, 8, 1),
                                                       (0, 1, 1, 1), (1000, 1, 4, 250)])
def test_most_per_device_is_what_a_run_fills(images, hosts, devices, most):
    assert slicing.most_per_device(images, hosts, devices) == most


REPORT = {"model": "random-sdxl", "width": 1024, "height": 1024, "dtype": "bf16", "guided": True, "steps": 20,
          "attention": "auto", "per_device_batch": 16, "total_gib": 21.3, "temp_gib": 14.2, "compiled": True,
          "tpu_type": "v5e", "hbm_gib": 16.0, "usable_gib": 15.75, "limit_gib": 14.175}


def test_the_refusal_names_the_figures_and_what_fits():
    report = REPORT
    assert tpu_check.refusal(report, 10) == (
        "random-sdxl 1024x1024 bf16 (guided, 20 steps, --attention auto) at 16 image(s) per chip needs 21.30 GiB of "
        "a v5e chip's 16 GiB (15.75 GiB usable, 14.18 GiB with 10% headroom); 10 per chip fit")
    assert "not even one image per chip fits" in tpu_check.refusal(report, None)
    assert tpu_check.refusal(report, 10, estimated=True).endswith(
        "; about 10 per chip fit (estimated from the step's parts: --per-device-batch auto finds and confirms the "
        "largest)")
    assert tpu_check.refusal({**report, "compiled": False, "crashed": "SIGSEGV"}, None) == (
        "random-sdxl 1024x1024 bf16 (guided, 20 steps, --attention auto) at 16 image(s) per chip does not compile "
        "for a v5e chip: libtpu's compiler crashed (SIGSEGV) on it, as it would on the TPU host; another "
        "--per-device-batch may compile (auto searches the ones that do)")


def _inline(call, *args):
    """The check's compiles in this process (the tests that replace what they call)."""
    return call(*args)


class _Shapes:
    """A model of no shapes at all, for the tests that replace whatever would read them."""
    params, param_dtype, family = {}, None, None

    def size(self, width, height):
        return width or 32, height or 32

    def steps(self, steps):
        return 20 if steps is None else steps


def test_a_refusal_estimates_what_fits_from_the_refused_program_and_the_parts(monkeypatch):
    """No other whole program is compiled: the refused one's total, grown or shrunk as the
    parts of a step do."""
    limit = 100 * 2 ** 20
    monkeypatch.setattr(tpu_check.chips, "capacity", lambda target: (limit, limit))
    monkeypatch.setattr("pipeline.generate.runtime.abstract_model", lambda settings: _Shapes())
    monkeypatch.setattr(tpu_check.search, "parts_memory", lambda context, b, enough=None: 12 * b * 2 ** 20)
    report = {**REPORT, "per_device_batch": 16, "total_gib": (10 + 12 * 16) / 1024}  # the whole: 10 + 12b MiB
    assert tpu_check.estimated_fit(Settings(), tpu_check.Target("v5e", 4, 16.0), report) == 7
    monkeypatch.setattr(tpu_check.search, "parts_memory", lambda context, b, enough=None: 200 * b * 2 ** 20)
    assert tpu_check.estimated_fit(Settings(), tpu_check.Target("v5e", 4, 16.0),
                                   {**report, "total_gib": 3300 / 1024}) is None


def test_the_search_confirms_the_parts_estimate_with_the_whole_program(monkeypatch):
    """The parts predict; the whole program decides, and what it measured beyond its parts
    corrects the next prediction. No whole program at one image is compiled unless the
    parts say nothing larger fits."""
    limit, mib = 100 * 2 ** 20, 2 ** 20
    whole = {b: (10 + 12 * b) * mib for b in range(1, 300)}  # fits up to 7
    compiled = []

    def check(context, b):
        compiled.append(b)
        return {**REPORT, "per_device_batch": b, "total_gib": whole[b] / GIB, "compiled": True}

    monkeypatch.setattr(tpu_check.chips, "capacity", lambda target: (limit, limit))
    monkeypatch.setattr(tpu_check.search, "program_report", check)
    monkeypatch.setattr("pipeline.model.sharding.device_bytes", lambda params, fsdp, dtype: 0)  # the weights: a bound
    monkeypatch.setattr(tpu_check.search, "parts_memory", lambda context, b, enough=None: (8 + 10 * b) * mib)
    context = tpu_check.Context.of(Settings(), tpu_check.Target("v5e", 4, 16.0), _Shapes())
    found = tpu_check.search_largest(context, 256)
    # the parts alone say 9; the whole at 9 needs 118/98 of its parts, so 7; confirmed, and 8 is 94/78 of 88 MiB
    assert found["batch"] == 7 and compiled == [9, 7]
    assert found["tried"][8] == math.ceil(94 / 78 * 88 * mib) and found["tried"][7] == whole[7]
    monkeypatch.setattr(tpu_check.search, "parts_memory", lambda context, b, enough=None: (9 + 12 * b) * mib)  # whole
    compiled.clear()
    assert tpu_check.search_largest(context, 256)["batch"] == 7 and compiled == [7]
    whole.update({b: (2 + 12 * b) * mib for b in whole})  # the parts overestimate: the whole at 7 shows 8 fits
    compiled.clear()
    assert tpu_check.search_largest(context, 256)["batch"] == 8 and compiled == [7, 8]
    crashes = range(6, 300)  # the compiler crashes on the whole program from 6 images: bisected below the first
    monkeypatch.setattr(tpu_check.search, "program_report", lambda context, b: check(context, b) if b not in crashes
                        else {**check(context, b), "total_gib": 0.0, "compiled": False, "crashed": "SIGSEGV"})
    compiled.clear()
    # the parts say 7, which crashes; 3 compiles, and the parts would say 8 again, but after a crash are not asked
    assert tpu_check.search_largest(context, 256)["batch"] == 5 and compiled == [7, 3, 5, 6]
    monkeypatch.setattr(tpu_check.search, "program_report", check)
    monkeypatch.setattr(tpu_check.search, "parts_memory", lambda context, b, enough=None: 200 * b * mib)
    whole[1] = limit + 1
    compiled.clear()
    refused = tpu_check.search_largest(context, 256)  # the parts say none: the whole at 1 gives the figures
    assert refused["batch"] is None and "not even one image per chip fits" in refused["message"] and compiled == [1]
    # the parts need not grow with the batch (XLA's buffer assignment): at one image they say none fits, the
    # whole at 1 fits; the parts above 1 are asked before the search ends: 9, no; rescaled, 7, which fits
    whole.update({b: (10 + 12 * b) * mib for b in whole})
    monkeypatch.setattr(tpu_check.search, "parts_memory",
                        lambda context, b, enough=None: (105 if b == 1 else 8 + 10 * b) * mib)
    compiled.clear()
    assert tpu_check.search_largest(context, 256)["batch"] == 7 and compiled == [1, 9, 7]


def test_a_stopped_search_goes_on_without_compiling_its_parts_again(monkeypatch, tmp_path, model_cache):
    """Each batch's parts are remembered in the compile cache's folder, keyed by the
    program and the target: a second search at the same batch compiles nothing; another
    batch, attention or TPU type is compiled."""
    from pipeline.generate import compile_cache

    monkeypatch.setattr(compile_cache.folders, "local_default", lambda: str(tmp_path))
    compiled = []

    def compile_parts(context, b, enough):
        compiled.append((context.settings.attention, context.target.tpu_type, b))
        return 1000 * b + len(compiled), True

    monkeypatch.setattr(tpu_check.step_parts, "_compiled_parts_memory", compile_parts)
    monkeypatch.setattr(tpu_check.child, "compiled", _inline)
    v5e, v6e = (program_check.target(tpu.lookup(name, "2x2")) for name in ("v5e", "v6e"))
    settings = Settings(model="tiny", steps=1, dtype="bf16", devices_per_host=4).validate()
    context = tpu_check.Context.of(settings, v5e)
    first = [tpu_check.parts_memory(context, b) for b in (1, 2)]
    assert first == [1001, 2002] and compiled == [("auto", "v5e", 1), ("auto", "v5e", 2)]
    assert [tpu_check.parts_memory(context, b) for b in (2, 1)] == [2002, 1001]
    assert len(compiled) == 2  # remembered: what a stopped search had compiled is not compiled again
    assert len(list((tmp_path / compile_cache.CHECKS).iterdir())) == 2
    tpu_check.parts_memory(tpu_check.Context.of(settings.replace(attention="xla"), v5e), 1)
    tpu_check.parts_memory(tpu_check.Context.of(settings, v6e), 1)
    tpu_check.parts_memory(context, 3)
    assert compiled[2:] == [("xla", "v5e", 1), ("auto", "v6e", 1), ("auto", "v5e", 3)]


def test_the_parts_of_a_batch_that_cannot_fit_stop_at_the_first_part_past_the_chip(monkeypatch, tmp_path,
                                                                                    model_cache):
    """A search compiles the parts of batches that do not fit too: the VAE decode, which
    needs the most at large batches, is compiled first, and once a part is past what could
    fit, the others are not compiled (minutes each at real sizes). The lower bound that is
    remembered answers "too much" again, and is compiled anew where a larger bound is asked."""
    import jax

    from pipeline.generate import compile_cache

    monkeypatch.setattr(compile_cache.folders, "local_default", lambda: str(tmp_path))
    monkeypatch.setattr(tpu_check.chips, "host_devices", lambda target: jax.devices("cpu")[:4])
    needs = {"text_encoder": 10, "denoiser": 50, "vae_decode": 80}  # bytes beyond weights, per image
    compiled = []

    def parts(model, width, height, b, guided, seam, sharding, count=False):
        return [(label, (), (label, b)) for label in needs]

    def figures(lowered, target):
        compiled.append(lowered)
        label, b = lowered
        return {"total": needs[label] * b}

    monkeypatch.setattr("pipeline.generate.parts.parts", parts)
    monkeypatch.setattr(tpu_check.compiling, "assigned_figures", figures)
    monkeypatch.setattr(tpu_check.child, "compiled", _inline)
    # a run that decodes the whole batch at once (planned before --decode-batch)
    settings = Settings(model="tiny", steps=1, dtype="bf16", devices_per_host=4, decode_batch=None).validate()
    context = tpu_check.Context.of(settings, program_check.target(tpu.lookup("v5e", "2x2")))
    assert tpu_check.parts_memory(context, 2) == 160  # the most of all three
    assert compiled == [("vae_decode", 2), ("denoiser", 2), ("text_encoder", 2)]
    compiled.clear()
    assert tpu_check.parts_memory(context, 3, enough=200) == 240  # at least 240: too much
    assert compiled == [("vae_decode", 3)]
    assert tpu_check.parts_memory(context, 3, enough=200) == 240 and len(compiled) == 1
    assert tpu_check.parts_memory(context, 3, enough=230) == 240 and len(compiled) == 1
    assert tpu_check.parts_memory(context, 3, enough=300) == 240  # the bound says nothing here
    assert compiled[1:] == [("vae_decode", 3), ("denoiser", 3), ("text_encoder", 3)]
    assert tpu_check.parts_memory(context, 3) == 240 and len(compiled) == 4  # now complete
    # --decode-batch auto (1): the program decodes one image at a time, and so does its VAE part
    compiled.clear()
    micro = tpu_check.Context.of(settings.replace(decode_batch="auto"), context.target)
    assert micro.settings.decode_batch == 1 and micro.spec(1).decode_batch == 1
    assert tpu_check.parts_memory(micro, 3) == 150  # the denoiser's, at 3
    assert ("vae_decode", 1) in compiled and ("vae_decode", 3) not in compiled


def test_a_batch_whose_parts_crash_the_compiler_is_one_that_does_not_fit(monkeypatch, tmp_path, model_cache):
    """libtpu's compiler crashing on a part (a signal, in the compiling child) is a result:
    that batch does not compile, so the search looks below it, and the crash is remembered,
    so a second search does not compile it again."""
    import jax

    from pipeline.generate import compile_cache, compile_process

    limit, mib = 100 * 2 ** 20, 2 ** 20
    compiled = []

    def compile(call, context, b, index):
        assert call is tpu_check.assigned_part and index == -1
        compiled.append(b)
        if b >= 6:
            raise compile_process.Crashed("SIGSEGV", True, 40.0, "")
        return (8 + 10 * b) * mib, 1  # one part; alone, it would say 8 fit (the whole program: 7)

    monkeypatch.setattr(compile_cache.folders, "local_default", lambda: str(tmp_path))
    monkeypatch.setattr(tpu_check.chips, "host_devices", lambda target: jax.devices("cpu")[:4])
    monkeypatch.setattr(tpu_check.chips, "capacity", lambda target: (limit, limit))
    monkeypatch.setattr(tpu_check.search, "program_report", lambda context, b: {
        **REPORT, "per_device_batch": b, "total_gib": (10 + 12 * b) * mib / GIB})
    monkeypatch.setattr(tpu_check.child, "compiled", compile)
    settings = Settings(model="tiny", steps=1, dtype="bf16", devices_per_host=4).validate()
    context = tpu_check.Context.of(settings, tpu_check.Target("v5e", 4, 16.0))
    assert tpu_check.search_largest(context, 256)["batch"] == 5
    assert any(b >= 6 for b in compiled)
    first = list(compiled)
    assert tpu_check.search_largest(context, 256)["batch"] == 5 and compiled == first  # all remembered
    with pytest.raises(tpu_check.TpuCheckError, match=r"compiler crashed \(SIGSEGV\) on a part of a step"):
        tpu_check.parts_memory(context, 7)  # where the figure itself is needed


REPORT_TEXT = """Memory Space: default (color=0)
Total bytes: 512287264 (488.55MiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list

Memory Space: vmem (color=1)
Total bytes: 80749568 (77.01MiB)
"""


def test_the_memory_usage_report_is_read_once_xla_has_written_it_whole(tmp_path):
    """The HBM total is the default memory space's, not VMEM's; the report counts only once
    the dump XLA writes after it is there, or once the compile has ended."""
    assert tpu_check.memory_report(str(tmp_path / "none")) is None
    (tmp_path / "m.jit_decode.after_optimizations-memory-usage-report.txt").write_text(REPORT_TEXT)
    assert tpu_check.memory_report(str(tmp_path)) is None  # it may still be being written
    assert tpu_check.memory_report(str(tmp_path), complete=True) == 512287264
    (tmp_path / "m.jit_decode.after_optimizations_after_buffer_assignment.txt").write_text("HloModule")
    assert tpu_check.memory_report(str(tmp_path)) == 512287264
    (tmp_path / "m.jit_decode.after_optimizations-memory-usage-report.txt").write_text("Memory Space: vmem (color=1)")
    with pytest.raises(tpu_check.TpuCheckError, match="names no default memory space"):
        tpu_check.memory_report(str(tmp_path))


def test_a_part_is_measured_at_buffer_assignment_in_a_child_of_its_own(tmp_path, model_cache, monkeypatch):
    """tiny's text encoder for a v5e chip, in a real compiling child that answers once XLA's
    memory-usage report is written: what it needs beyond its weights is close to what the
    whole compile of the same program finds (the backend moves a little after buffer
    assignment), and each figure is kept by the program's text, apart."""
    from pipeline.generate import compile_cache

    monkeypatch.setattr(compile_cache.folders, "local_default", lambda: str(tmp_path))
    # 1024 images (2048 guided rows): its activations, about 0.17 GiB, are in HBM; fewer, XLA keeps them in VMEM
    settings = Settings(model="tiny", width=32, height=32, steps=1, dtype="bf16", devices_per_host=4).validate()
    v5e = program_check.target(tpu.lookup("v5e", "2x2"))
    context = tpu_check.Context.of(settings, v5e)
    beyond, count = tpu_check.child.compiled(tpu_check.assigned_part, context, 1024, 0)
    assert count == 3  # the text encoder, the UNet, the VAE decode
    [(label, _, lowered), *_] = tpu_check.lowered_parts(context, 1024)
    assert label == "text_encoder"
    whole = tpu_check.compiled_figures(lowered, v5e, lambda e: {"total": fit.program_memory(e)["total"]})
    weights = tpu_check.program.nbytes(context.model.params["text_encoder"])
    assert 0.9 * (whole["total"] - weights) <= beyond <= 1.1 * (whole["total"] - weights)
    kept = [json.load(open(p)) for p in (tmp_path / compile_cache.CHECKS).glob("*.json")]
    assert len(kept) == 2 and {k["total"] for k in kept} == {whole["total"], beyond + weights}
    assert not list(tmp_path.glob("**/xla-dump-*"))  # the child's dump went with its folder


SEGFAULT = "import os, signal; open(os.environ['PROMPTMILL_HELD_STDERR'], 'w').write('F1125 {}'); os.kill(os.getpid(), signal.{})"
# a real compiling child, whose compiler prints and crashes on the program it was given
CRASHING_COMPILER = ("import os, signal, sys, jax.stages as s; s.Lowered.compile = lambda self, *a, **k: "
                     "(os.write(2, b'F1125 check failed'), os.kill(os.getpid(), signal.SIGSEGV)); "
                     "from pipeline.generate import compile_process as c; sys.exit(c.main(sys.argv[1:]))")


def test_a_compiler_crash_is_a_refusal_that_says_so_and_is_remembered(monkeypatch, tmp_path, model_cache, capsys):
    """The compile runs in a child process: one that dies of SIGSEGV (as libtpu's compiler
    did on a real program) ends the submission with a refusal naming the crash and what
    libtpu printed, and the next submission of the same program is refused without
    compiling, even after promptmill's code changed (the crash is kept under the program's
    own text too); one killed from outside (SIGKILL) is an error, and nothing is
    remembered."""
    import sys

    from pipeline.generate import compile_cache, compile_process

    monkeypatch.setattr(compile_cache.folders, "local_default", lambda: str(tmp_path))
    real = compile_process.COMMAND
    argv = ["submit", "gke", "--dry-run", "--tpu-type", "v5e", "--topology", "2x2", "--image", "img",
            "--prompts", "gs://b/p.jsonl", "--out", "gs://b/out", "--model", "tiny", "--steps", "1"]
    monkeypatch.setattr(compile_process, "COMMAND", [sys.executable, "-c", SEGFAULT.format("killed", "SIGKILL")])
    assert cli.main([*argv, "--per-device-batch", "2"]) == 1
    err = capsys.readouterr().err
    assert "was stopped: the compiling process died of SIGKILL" in err.strip().splitlines()[-1]
    [event] = _events(err, "tpu_compile_crashed")
    assert event["signal"] == "SIGKILL" and not event["compiler"] and event["per_device_batch"] == 2

    monkeypatch.setattr(compile_process, "COMMAND", [sys.executable, "-c", CRASHING_COMPILER])
    assert cli.main([*argv, "--per-device-batch", "2"]) == 1  # not remembered: compiled again, and crashed
    err = capsys.readouterr().err
    message = err.strip().splitlines()[-1]
    assert message.startswith("promptmill submit: error: the TPU check refuses this submission: tiny ")
    assert ("at 2 image(s) per chip does not compile for a v5e chip: libtpu's compiler crashed (SIGSEGV) on it"
            in message)
    [event] = _events(err, "tpu_compile_crashed")
    assert event["signal"] == "SIGSEGV" and event["compiler"] and event["printed"].startswith("F1125 check failed")
    assert not event["remembered"]
    [program] = _events(err, "tpu_program")
    assert program["crashed"] == "SIGSEGV" and not program["compiled"] and not program["fits"]
    crashes = [json.load(open(p)) for p in (tmp_path / compile_cache.CHECKS).glob("*.json")]
    assert sum(set(c) == {"crashed", "compile_s"} for c in crashes) == 1  # by the program's own text

    monkeypatch.setattr(compile_process, "COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])
    assert cli.main([*argv, "--per-device-batch", "2"]) == 1  # remembered: no child started
    assert "libtpu's compiler crashed (SIGSEGV)" in capsys.readouterr().err.strip().splitlines()[-1]

    monkeypatch.setattr(compile_process, "COMMAND", real)
    monkeypatch.setattr(compile_cache.keys, "code_digest", lambda: "promptmill changed")  # a new index key
    assert cli.main([*argv, "--per-device-batch", "2"]) == 1  # a real child, which finds the crash, not compiling
    err = capsys.readouterr().err
    assert "libtpu's compiler crashed (SIGSEGV)" in err.strip().splitlines()[-1]
    [event] = _events(err, "tpu_compile_crashed")
    assert event["remembered"] and event["signal"] == "SIGSEGV"

    monkeypatch.setattr(compile_process, "COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])
    assert cli.main([*argv, "--per-device-batch", "3"]) == 1  # another program: a child, which says nothing
    assert "exited with 3 and no answer" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_compiling_child_hands_back_its_errors():
    with pytest.raises(tpu_check.TpuCheckError, match="a TPU host of 3 chips is not one the check knows"):
        tpu_check.child.compiled(tpu_check.compile_program, tpu_check.Context(
            Settings(model="tiny"), tpu_check.Target("v5e", 3, 16.0), None, 32, 32, False), 1)  # no model needed
    with pytest.raises(ValueError, match="a compiling child runs one of"):
        tpu_check.child.compiled(tpu_check.largest_batch, Settings(), tpu_check.Target("v5e", 4, 16.0))


def test_a_compiling_child_reads_no_pickle_from_a_folder_others_may_write(tmp_path):
    """The request and answer are pickles this process tree writes into its own 0700
    folder; a file anywhere else (here a folder others may write) is never unpickled."""
    import pickle

    from pipeline.generate import compile_process

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    marker = tmp_path / "ran"
    (shared / "request").write_bytes(pickle.dumps((os.system, (f"touch {marker}",))))
    with pytest.raises(compile_process.Failed, match="not in a private folder of this user"):
        compile_process.main([str(shared / "request"), str(shared / "answer")])
    assert not marker.exists()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "answer").write_bytes(pickle.dumps((True, 42)))
    assert compile_process._load_private(str(private / "answer")) == (True, 42)


# ---------------------------------------------------------------- real TPU programs

def _events(text: str, name: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{") and f'"event": "{name}"' in line]


@pytest.fixture(scope="module")
def no_weights(tmp_path_factory, model_cache):
    """The tiny checkpoint with every weight file replaced by bytes no reader accepts: a
    check that read one would fail."""
    from pipeline.model import load as model_load

    folder = tmp_path_factory.mktemp("no-weights") / "tiny"
    shutil.copytree(model_load.resolve("tiny"), folder)
    weights = [p for p in folder.rglob("*") if p.suffix in (".msgpack", ".safetensors")]
    assert weights
    for path in weights:
        path.write_bytes(b"\xff" * 64)
    return str(folder)


def test_a_v5e_host_program_with_the_pallas_kernel_compiles_from_shapes_alone(no_weights, monkeypatch):
    """tiny at 128x128: the UNet's first attention and the VAE's are 4096-token calls, where
    auto runs the Pallas kernel on TPU; the program contains it and compiles for a v5e host.
    What the compile found is kept by the program's text: once promptmill's code changes
    around a program that stays the same, it is not compiled again."""
    from pipeline.generate import compile_cache

    settings = Settings(model=no_weights, width=128, height=128, steps=1, dtype="bf16", per_device_batch=1,
                        devices_per_host=4, guidance_scale=1.0).validate()
    v5e = program_check.target(tpu.lookup("v5e", "2x2"))
    report = tpu_check.check(settings, v5e)
    assert report["compiled"] and report["fits"] and report["chips_per_host"] == 4
    kernels = {(k["site"], k["q_tokens"], k["kv_tokens"]): k["kernel"] for k in report["kernels"]}
    assert kernels[("unet", 4096, 4096)] == kernels[("vae", 4096, 4096)] == "pallas"
    assert kernels[("unet", 1024, 1024)] == "xla"  # below the kernel's threshold
    # the weights, in bf16, are the arguments; the chip's usable HBM is XLA's figure
    assert 0 < report["argument_gib"] < report["total_gib"] < 1 and report["usable_gib"] == 15.75
    assert report["hbm_gib"] == 16 and report["libtpu"] == tpu_check.libtpu_version()
    assert report["pallas_calls"] >= 2  # the compiled program holds the kernels, as Mosaic custom calls
    assert report["flops_per_image"] > 0 and not report["guided"]

    monkeypatch.setattr(compile_cache.keys, "code_digest", lambda: "promptmill's next version")
    again = tpu_check.check(settings, v5e)
    assert not again["from_cache"]  # a new version: the check's own index does not know it
    # the compiling child lowered it again and found its figures by the program's text: the first compile's
    # seconds, not a second compile's
    same = ("argument_gib", "temp_gib", "total_gib", "compile_s", "pallas_calls", "kernels", "xla_flops_per_image")
    assert {k: again[k] for k in same} == {k: report[k] for k in same}


def test_submit_gke_dry_run_checks_a_v6e_host_and_refuses_what_does_not_fit(model_cache, capfd, monkeypatch):
    """tiny-sdxl on one 8-chip v6e host: the dry run logs the tpu_program event and says it
    fits; the same program on a chip of a hundredth of a GiB (--device-memory) is refused
    with the figures, before anything is planned or launched. While a program compiles, a
    heartbeat says which and for how long (every 30 s; here every 0.02 s)."""
    from pipeline.generate.tpu_check import report

    monkeypatch.setattr(report, "HEARTBEAT_S", 0.02)
    argv = ["submit", "gke", "--dry-run", "--tpu-type", "v6e", "--topology", "2x4", "--image", "img",
            "--prompts", "gs://b/p.jsonl", "--out", "gs://b/out", "--model", "tiny-sdxl", "--steps", "1",
            "--per-device-batch", "1"]
    assert cli.main(argv) == 0
    out, err = capfd.readouterr()
    [event] = _events(err, "tpu_program")
    assert event["fits"] and event["tpu_type"] == "v6e" and event["chips_per_host"] == 8
    # what libtpu reports a v6e chip leaves one program: 31.24 GiB since libtpu 0.0.50 (0.0.42 said 31.25)
    assert event["dtype"] == "bf16" and event["per_device_batch"] == 1 and event["usable_gib"] == 31.24
    for field in ("argument_gib", "temp_gib", "total_gib", "hbm_gib", "compile_s", "jax", "libtpu", "topology"):
        assert field in event
    assert "# TPU check: the host program fits" in out and "\n---\n" in out
    assert "TPU_ACCELERATOR_TYPE" not in err  # libtpu's warnings without a TPU are held back
    assert "deprecated" not in err  # nor the libraries' warnings, in the compiling child (stderr's file, captured)
    beats = _events(err, "tpu_program_still_compiling")
    assert beats and {b["program"] for b in beats} == {"the host program"} and beats[0]["tpu_type"] == "v6e"
    assert [b["elapsed_s"] for b in beats] == sorted(b["elapsed_s"] for b in beats)

    assert cli.main([*argv, "--device-memory", "0.01"]) == 1
    out, err = capfd.readouterr()
    assert out == ""
    message = err.strip().splitlines()[-1]
    assert message.startswith("promptmill submit: error: the TPU check refuses this submission: tiny-sdxl 32x32 "
                              "bf16 (guided, 1 steps, --attention auto) at 1 image(s) per chip needs ")
    assert "of a v6e chip's 0.01 GiB" in message and "not even one image per chip fits" in message

    # with scores, the scoring program is compiled for the chips too: its weights stay beside the sampler's
    assert cli.main([*argv, "--score", "clip,aesthetic,safety", "--clip-model", "tiny-clip", "--aesthetic-head",
                     "tiny-aesthetic", "--safety-checker", "tiny-safety-checker"]) == 0
    err = capfd.readouterr().err
    [scored] = _events(err, "tpu_program")
    assert {b["program"] for b in _events(err, "tpu_program_still_compiling")} == {"the scoring program"}
    assert scored["scores"] == ["clip", "aesthetic", "safety"] and scored["fits"]
    assert scored["argument_gib"] == event["argument_gib"] and scored["temp_gib"] == event["temp_gib"]  # the sampler
    assert scored["sampler_total_gib"] == event["total_gib"]
    assert 0 < scored["scorer_argument_gib"] < scored["scorer_total_gib"]
    assert scored["total_gib"] == pytest.approx(max(event["total_gib"] + scored["scorer_argument_gib"],
                                                    scored["scorer_total_gib"] + event["argument_gib"]), abs=0.002)
    # the tiny scorers' weights are under half a MiB: at the report's 3 decimals of a GiB the total may not move
    assert scored["total_gib"] >= event["total_gib"]


def test_bench_tpu_compiles_the_sampler_and_the_scorer_for_the_chips(tmp_path, model_cache, capsys):
    """The dry run's program above (the module's compile cache has its figures), as a bench
    row with the tiny scorers: the table and the JSON report have the scorer's share."""
    path = tmp_path / "tpu.json"
    assert cli.main(["bench", "tpu", "--model", "tiny-sdxl", "--steps", "1", "--targets", "v6e:2x4",
                     "--scorers", "tiny", "--report", str(path)]) == 0
    table = capsys.readouterr().out
    [row] = json.loads(path.read_text())["rows"]
    assert row["scores"] == ["clip", "aesthetic", "safety"] and row["fits"] and row["chips_per_host"] == 8
    assert row["total_gib"] == pytest.approx(max(row["sampler_total_gib"] + row["scorer_argument_gib"],
                                                 row["scorer_total_gib"] + row["argument_gib"]), abs=0.002)
    assert row["total_gib"] >= row["sampler_total_gib"] > row["argument_gib"]  # (the tiny scorers: see above)
    assert row["scorer_compile_s"] > 0
    assert "with the scorer's" in table and "v6e" in table
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "tpu", "--scorers", "large"])


def test_without_libtpu_a_submission_says_how_to_install_it_or_skip(monkeypatch, capsys):
    monkeypatch.setattr(tpu_check.chips, "libtpu_version", lambda: None)
    argv = ["submit", "gke", "--dry-run", "--tpu-type", "v5e", "--topology", "2x2", "--image", "img",
            "--prompts", "gs://b/p.jsonl", "--out", "gs://b/out"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert 'pip install "promptmill[tpu]"' in err and "--no-tpu-check" in err
    assert cli.main([*argv, "--no-tpu-check"]) == 0
    assert "# TPU check: skipped (--no-tpu-check)" in capsys.readouterr().out
    assert cli.main([*argv, "--no-tpu-check", "--per-device-batch", "auto"]) == 1
    assert "--per-device-batch auto is resolved by the TPU check" in capsys.readouterr().err


def test_auto_never_picks_more_than_the_run_fills(tmp_path, model_cache, monkeypatch):
    """The README demo (43 images on 2 hosts x 2 devices) with --per-device-batch auto: the
    tiny model fits 256 images a device, the run fills ceil(43 / 4) = 11; a resumed plan
    keeps what its slices were cut with."""
    monkeypatch.setattr(fit, "choose_per_device_batch", lambda settings, **kw: 256)
    out = str(tmp_path / "out")
    argv = ["plan", "--prompts", os.path.join(ROOT, "examples", "prompts.jsonl"), "--out", out,
            "--per-device-batch", "auto", "--devices-per-host", "2", "--hosts", "2"]
    assert cli.main(argv) == 0
    from pipeline.io import runs, storage
    from pipeline.core import naming

    manifest = storage.read_json(naming.manifest(out))
    assert manifest["images"] == 43 and runs.read(out).settings.per_device_batch == 11
    assert manifest["slice_size"] == 2 * 11 * 2 and manifest["slices"] == 1
    monkeypatch.setattr(fit, "choose_per_device_batch", lambda settings, **kw: pytest.fail("chosen again"))
    assert cli.main(argv) == 0 and runs.read(out).settings.per_device_batch == 11


def test_a_submission_resolves_auto_against_the_target_chip_and_caps_it_for_the_slices_hosts(monkeypatch):
    checked = []
    monkeypatch.setattr(tpu_check, "largest_batch", lambda settings, target: (40, {}))
    monkeypatch.setattr(tpu_check, "check", lambda settings, target: checked.append(settings.per_device_batch) or {
        "fits": True, "kernels": []})
    s = tpu.lookup("v5e", "4x4")  # 4 hosts of 4 chips
    settings, report, cap = program_check.resolve_submission(
        Settings(out="gs://b/out", per_device_batch=AUTO, devices_per_host=4), s, look=False)
    assert settings.per_device_batch == 40 and checked == [40] and cap == 4
    settings, report, cap = program_check.resolve_submission(
        Settings(out="gs://b/out", per_device_batch=3, devices_per_host=4), s, look=False)
    assert settings.per_device_batch == 3 and cap is None


def test_an_ironwood_host_program_compiles_for_its_eight_devices(model_cache):
    """TPU7x: a host of 4 chips is 8 devices (two TensorCores a chip), each with half a chip's
    HBM; the check compiles the host's program for the 8 and measures it against 96 GiB. The
    program is FLUX.2 [klein] base's guided one (tiny-klein-base: Qwen3, the transformer at
    twice the rows, the batch-norm VAE), as MaxDiffusion runs klein on Ironwood."""
    s = tpu.lookup("tpu7x", "2x2x1")
    target = program_check.target(s)
    assert (target.chips, target.dims, target.devices_per_chip, target.hbm_gib) == (4, 3, 2, 96.0)
    assert target.host_topology == ("tpu7x:2x2x1", (2, 2, 1)) and len(tpu_check.host_devices(target)) == 8
    settings = Settings(model="tiny-klein-base", width=32, height=32, steps=1, dtype="bf16", per_device_batch=1,
                        devices_per_host=s.devices_per_host, attention="xla", max_sequence_length=32).validate()
    report = tpu_check.check(settings, target)
    assert report["compiled"] and report["fits"] and report["chips_per_host"] == 4 and report["guided"]
    assert 0 < report["total_gib"] < 1 < report["usable_gib"] <= 96


def test_a_zimage_host_program_with_masked_pallas_attention_compiles_for_v6e(model_cache):
    """tiny-zimage's guided program with --attention flash: every attention call runs the
    Pallas kernel, the caption lengths hiding keys through its segment ids (the refiners'
    and the main layers'), and the program compiles for a v6e host's chips."""
    s = tpu.lookup("v6e", "2x2")
    settings = Settings(model="tiny-zimage", width=32, height=32, steps=1, dtype="bf16", per_device_batch=1,
                        devices_per_host=s.devices_per_host, attention="flash", max_sequence_length=48,
                        guidance_scale=3.0).validate()
    report = tpu_check.check(settings, program_check.target(s))
    assert report["compiled"] and report["fits"] and report["guided"]
    sites = {k["site"] for k in report["kernels"] if k["kernel"] == "pallas"}
    assert "zimage" in sites and report["pallas_calls"] >= 3
