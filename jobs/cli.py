"""The ``promptmill`` command: parse flags, set up logs, call one library function.

Flags a subcommand does not know are passed to Beam as PipelineOptions (run, plan, collect
and submit), e.g. ``--runner DirectRunner --direct_num_workers 2``, if Beam knows them; any
other unknown flag is an error that names the closest known one (``jobs.strict.check_extra``).
No flag is abbreviated, and a flag that takes one value given twice is an error
(``jobs.flags.Parser``). Every command that works on one run takes its OUT as its positional
argument or as ``--out`` (``jobs.strict.take_out``; ``reproduce``'s positional arguments are keys).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from pipeline.core import logs

logs.drop_beams_apitools_warning()  # before anything imports Beam

from pipeline.generate import environment  # noqa: E402

environment.pin_cpu_threads()  # before anything starts jax's CPU backend: the same programs on any device count

from jobs import flags, strict  # noqa: E402
from jobs.bench_command import add_bench_parser, run_bench  # noqa: E402
from jobs.flags import add_compile_cache_flag, add_date_flag, add_overwrite_flag, add_settings_flags  # noqa: E402
from jobs.submit_command import SUMMARY, add_submit_parser, run_submit  # noqa: E402
from pipeline import __version__  # noqa: E402
from pipeline.model import families  # noqa: E402

_settings = flags.settings_from_args  # the one translation of the settings flags; the old name, still used by tests


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    # a flags.Parser, as every subcommand's parser then is: no abbreviations, no flag twice
    parser = flags.Parser(prog="promptmill", description=f"Generate image datasets from text prompts with diffusion "
                          f"models ({families.titles()}) in JAX/Flax, on TPU pods or local CPU devices. Flags are "
                          f"written in full (no abbreviations), and a flag that takes one value is given once (--lora "
                          f"repeats). A command that works on one run takes its OUT as its positional argument or "
                          f"as --out (reproduce: --out; its positional arguments are image keys).")
    parser.add_argument("--version", action="version", version=f"promptmill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    dated = []

    run = sub.add_parser("run", help="plan, generate on local host processes, and collect")
    dated.append(run)
    add_settings_flags(run)
    run.add_argument("--engine", choices=("pod", "beam"), default="pod",
                     help="pod: plan, then --hosts local host processes (jax.distributed), then collect; beam: the "
                          "whole job as one Beam pipeline (the DirectRunner unless --runner says otherwise) whose "
                          "workers each generate on --devices-per-host local devices, as on Dataflow "
                          "(default: %(default)s)")
    run.add_argument("--hosts", type=_positive_int, default=None,
                     help="local host processes, with --engine pod (default: 2)")
    run.add_argument("--devices-per-host", type=int, default=2, help="CPU devices per host (default: %(default)s)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_overwrite_flag(run)
    add_compile_cache_flag(run, local_default=True)
    flags.add_gallery_flags(run)

    plan = sub.add_parser("plan", help="validate prompts and cut them into slices (Beam)")
    dated.append(plan)
    add_settings_flags(plan)
    plan.add_argument("--devices-per-host", type=int, default=1,
                      help="devices of each generate host; sets the slice size (default: %(default)s)")
    plan.add_argument("--hosts", type=_positive_int, default=1,
                      help="generate hosts the run will have: with --per-device-batch auto, the batch is at most "
                           "what the run fills, ceil(images / (hosts x devices per host)) (default: %(default)s)")
    add_overwrite_flag(plan)

    gen = sub.add_parser("generate", help="generate this host's slices (one process per host)")
    dated.append(gen)
    gen.add_argument("--out", help="the planned output folder or gs:// prefix")
    gen.add_argument("--coordinator", help="HOST:PORT of host 0's coordinator (omit on Cloud TPU / GKE)")
    gen.add_argument("--num-hosts", type=int, help="number of host processes (omit on Cloud TPU / GKE)")
    gen.add_argument("--host-id", type=int, help="this host's index (omit on Cloud TPU / GKE)")
    add_compile_cache_flag(gen)

    collect = sub.add_parser("collect", help="merge and verify the outputs into OUT/dataset (Beam)")
    dated.append(collect)
    collect.add_argument("--out", help="the output folder or gs:// prefix")
    flags.add_gallery_flags(collect)

    reproduce = sub.add_parser("reproduce", help="regenerate images from their metadata rows and check their sha256")
    dated.append(reproduce)
    reproduce.add_argument("keys", nargs="+", metavar="KEY", help="image keys (the metadata's 'key' column)")
    reproduce.add_argument("--out", required=True, help="the run's output folder or gs:// prefix")
    reproduce.add_argument("--save", metavar="DIR", help="also write the regenerated images here as KEY.EXT")

    for command in dated:
        doing = {gen: "the dated run whose slices this host generates", collect: "the dated run to collect",
                 reproduce: "the dated run whose images to regenerate"}.get(command)
        add_date_flag(command, doing)

    status = sub.add_parser("status", help="where a run stands: slices and images committed, rate and ETA, "
                            "hosts, collect (reads no image and no metadata shard)")
    status.add_argument("--out", help="the run's output folder or gs:// prefix")
    add_date_flag(status, "the dated run whose status to show")
    status.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    status.add_argument("--watch", type=float, metavar="N", help="print it again every N seconds, until Ctrl-C")

    for command in (run, plan, collect):
        strict.strict(command, beam=True, out=True)  # flags they do not know may be Beam options
    strict.strict(gen, out=True)
    strict.strict(status, out=True)
    strict.strict(reproduce)  # its positional arguments are keys: OUT is --out

    add_submit_parser(sub)  # submit dataflow|gke, with its own --date
    add_bench_parser(sub)  # bench generator|upload|plan|collect|status|pipeline|tpu|sizes
    # --quiet promises only what a command does: run has a progress bar and a summary for people,
    # collect a summary; the others print their results (stdout) and log events (stderr) alone
    quiet = {run: f"{_QUIET}, no progress bar, no summary", collect: f"{_QUIET}, no summary"}
    for command in commands(parser):
        command.add_argument("--log-level", choices=list(logs.LEVELS), default="info",
                             help="the least important JSON log events shown on stderr (default: %(default)s)")
        command.add_argument("--quiet", action="store_true", help=quiet.get(command, _QUIET))
        strict.show_positional_out(command)
    return parser


_QUIET = "warnings and errors only: no info events"


def commands(parser) -> list:
    """The parsers that run something: every subcommand, and every target of one that has them."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                nested = [a for a in child._actions if isinstance(a, argparse._SubParsersAction)]
                found += commands(child) if nested else [child]
    return found


def summary(command: str, out: str, stats: dict, seconds: float) -> str:
    """What a finished run or collect says to people (stderr; the JSON line on stdout is
    for scripts): the images this command made (a run's ``attempt``: a resumed run made
    only what was left, a finished one nothing) and those in the dataset, dropped and
    rejected, where the rejects and the dataset are, wall time and the rate of what it
    made, and what to run next."""
    dropped = (stats.get("dropped") or {}).get("images", 0)
    rejects = stats.get("rejects", 0)
    attempt = stats.get("attempt")  # what this command made (a run), as against what the dataset holds
    if attempt is None:
        made, rate = f"{stats['images']} image(s) in the dataset", ""
    elif not attempt["slices_generated"] and not attempt["slices_redone"]:
        made, rate = f"finished already: {stats['images']} image(s) in the dataset, none made now", ""
    else:
        before = stats["images"] - attempt["images_made"]
        made = (f"{attempt['images_made']} image(s) made{f' ({before} made before)' if before > 0 else ''}, "
                f"{stats['images']} in the dataset")
        rate = f", {attempt['images_made'] / attempt['generate_s']:.2f} images/s generating" \
            if attempt["generate_s"] > 0 and attempt["images_made"] else ""
    lines = [f"promptmill {command}: {made}, {dropped} dropped by filters, {rejects} input "
             f"row(s) rejected{' (OUT/plan/rejects/)' if rejects else ''}; {'verified' if stats.get('verified') else 'NOT verified'}",
             f"  {seconds:.1f} s{rate}",
             f"  dataset: {out.rstrip('/')}/ (its card README.md; dataset/metadata/, stats.json, index.html)",
             f"  next: promptmill status {out}  |  promptmill reproduce KEY --out {out}"]
    from pipeline.collect.card import all_dropped

    if all_dropped(stats):
        lines.insert(1, f"  warning: {all_dropped(stats)}")
    if rejects:
        lines[0] = lines[0].replace("OUT/", f"{out.rstrip('/')}/")
    return "\n".join(lines[:2] + _unused_lines(stats) + lines[2:])


def _unused_lines(stats: dict) -> list[str]:
    """What the records asked for that played no part, as stats.json counts it: said at the
    end too, not only in stats.json and the card."""
    said = []
    for name, what in (("truncated_prompts", "prompt(s) longer than the text encoder reads were cut to its length"),
                       ("guidance_unused", "record(s) gave a guidance_scale the model takes none of: unused"),
                       ("negative_prompts_unused", "record(s) gave a negative prompt that played no part (their "
                                                   "images are not guided)")):
        records = (stats.get(name) or {}).get("records", 0)
        if records:
            said.append(f"  note: {records} {what} ({name} in stats.json)")
    return said


# Commands whose own process has nothing to run on an accelerator: local runs put their hosts
# on CPU devices, and submissions compile for TPUs without one (the TPU check). With libtpu
# installed, JAX would otherwise look for a TPU at its first use, slowly and with warnings.
# A host (`generate`), `reproduce`, `plan` and `bench generator` use whatever the machine has.
_CPU_COMMANDS = ("run", "submit")
_CPU_BENCH = ("tpu",)


def _cpu_only(args) -> None:
    if args.command in _CPU_COMMANDS or (args.command == "bench" and args.target in _CPU_BENCH):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    from pipeline.core import interrupts, logs

    try:
        families.check()  # a plug-in family that cannot be registered: one line, before any command (or --help)
    except families.FamilyError as e:
        print(f"promptmill: error: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    beam_args = strict.check_extra(args, extra)  # an unknown flag exits 2 here, before anything runs
    _cpu_only(args)
    logs.setup(logs.LEVELS["warning" if getattr(args, "quiet", False) else getattr(args, "log_level", "info")])
    logs.quiet_library_tracebacks()  # a promptmill error is said once, in the command's own line
    try:
        if hasattr(args, "date"):
            from pipeline.cloud import dates as schedule

            args.out = schedule.resolve_out(args.out, args.date)
        with interrupts.raising(), _lease(args):  # SIGTERM stops a command as Ctrl-C does: hosts and workers first
            return _dispatch(args, beam_args)
    except KeyboardInterrupt as e:
        print(f"promptmill {args.command}: stopped by {interrupts.signal_name(e)}", file=sys.stderr)
        return interrupts.exit_code(e)
    except (ValueError, RuntimeError, OSError) as e:
        if interrupts.received() is not None:  # e.g. Beam's error for the step that took the SIGTERM
            stopped = interrupts.Interrupted(interrupts.received())
            print(f"promptmill {args.command}: stopped by {interrupts.signal_name(stopped)}", file=sys.stderr)
            return interrupts.exit_code(stopped)
        print(f"promptmill {args.command}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if not type(e).__module__.startswith("google.auth"):
            raise
        # e.g. DefaultCredentialsError: gs:// paths without credentials
        print(f"promptmill {args.command}: error: no usable Google Cloud credentials ({e}); run "
              "'gcloud auth application-default login', or set GOOGLE_APPLICATION_CREDENTIALS", file=sys.stderr)
        return 1


_WRITERS = ("run", "plan", "collect")  # the commands that write a run into OUT: one at a time (pipeline.io.lease)


def _lease(args):
    """The lease on OUT that a command writing a run holds while it works (``submit``
    takes its own, named after its job, once its flags are checked)."""
    import contextlib

    if args.command not in _WRITERS:
        return contextlib.nullcontext()
    from pipeline.io import lease

    return lease.Held(args.out, f"promptmill {args.command}")


def _run(args, beam_args: list[str]) -> int:
    started = time.perf_counter()
    settings = flags.settings_from_args(args, args.devices_per_host)
    if args.engine == "beam":
        from pipeline.engines import beam as beam_engine

        if args.hosts is not None:
            raise ValueError("--hosts is for --engine pod; with --engine beam each Beam worker generates on "
                             "its own --devices-per-host devices")
        stats = beam_engine.run_beam(settings, beam_args, overwrite=args.overwrite,
                                     compile_cache=args.compile_cache, gallery=flags.gallery_of(args))
    else:
        from pipeline.engines import local as launcher
        from pipeline.generate import compile_cache

        if args.compile_cache and args.no_compile_cache:
            raise ValueError("give --compile-cache DIR or --no-compile-cache, not both")
        cache = None if args.no_compile_cache else args.compile_cache or compile_cache.local_default()
        stats = launcher.run_local(settings, 2 if args.hosts is None else args.hosts, beam_args,
                                   progress=not (args.no_progress or args.quiet), compile_cache=cache,
                                   overwrite=args.overwrite, gallery=flags.gallery_of(args))
    _finish("run", settings.out, stats, time.perf_counter() - started, args.quiet)
    return 0


def _plan(args, beam_args: list[str]) -> int:
    import json

    from pipeline.generate import fit
    from pipeline.plan import transforms as plan

    # tpu_check: --device-memory is kept in run.json, for a submission's check after its plan
    asked = flags.settings_from_args(args, args.devices_per_host, tpu_check=True)
    settings = fit.resolve_per_device_batch(asked, args.overwrite)
    cap = fit.cap_hosts(asked, args.hosts, args.overwrite)
    print(json.dumps(plan.run_plan(settings, beam_args, args.overwrite, cap)))
    return 0


def _generate(args, beam_args: list[str]) -> int:
    from pipeline.generate import json_stderr

    json_stderr.route()  # first: every line of a host's log is JSON, the C++ libraries' too
    from pipeline.generate import cluster, host_loop as host

    host.generate(args.out, cluster.ClusterArgs(args.coordinator, args.num_hosts, args.host_id),
                  compile_cache=args.compile_cache)
    return 0


def _collect(args, beam_args: list[str]) -> int:
    from pipeline.collect import transforms as collect

    started = time.perf_counter()
    stats = collect.run_collect(args.out, beam_args, **flags.gallery_of(args))
    _finish("collect", args.out, stats, time.perf_counter() - started, args.quiet)
    return 0


def _reproduce(args, beam_args: list[str]) -> int:
    import json

    from pipeline.generate import reproduce

    results = reproduce.reproduce(args.out, args.keys, save=args.save,
                                  emit=lambda result: print(json.dumps(result), flush=True))
    mismatched = [r["key"] for r in results if not r["match"]]
    if mismatched:
        print(f"promptmill reproduce: {len(mismatched)} of {len(results)} image(s) differ from their metadata's "
              f"sha256: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    return 0


def _status(args, beam_args: list[str]) -> int:
    import json

    from pipeline.collect import status

    if args.watch is not None:
        status.watch(args.out, args.watch, args.json)
    else:
        report = status.status(args.out)
        print(json.dumps(report, sort_keys=True) if args.json else status.format_text(report))
    return 0


# each command's entry: (the parsed arguments, the Beam options) -> the exit status
COMMANDS = {"run": _run, "plan": _plan, "generate": _generate, "collect": _collect, "reproduce": _reproduce,
            "status": _status, "submit": lambda args, beam_args: run_submit(args, beam_args),
            "bench": lambda args, beam_args: run_bench(args)}


def _dispatch(args, beam_args: list[str]) -> int:
    return COMMANDS[args.command](args, beam_args)


def _finish(command: str, out: str, stats: dict, seconds: float, quiet: bool) -> None:
    """The end of ``run`` and ``collect``: the summary for people (stderr, unless ``quiet``),
    then the JSON line for scripts (stdout), so that the JSON is the last line printed in a
    terminal too, where the two streams meet."""
    import json

    if not quiet:
        print(summary(command, out, stats, seconds), file=sys.stderr, flush=True)
    print(json.dumps({k: stats[k] for k in SUMMARY}), flush=True)


def entry() -> None:
    """The ``promptmill`` command: ``main``, and the process ends with its exit code once
    every exit handler has run (JAX's shutdown, logging's, temporary folders'), without the
    interpreter's teardown of the libraries loaded (jax, Beam, flax, tensorstore):
    measured at 0.3 to 0.9 s per process on CPU after the work was done, on every host
    and every command. ``main`` itself returns, so it can be called in a process that goes on."""
    import atexit

    code = [1]  # an exception main let through: Python prints it, and the exit code is 1

    # registered first, so it runs after every other exit handler (importing this module
    # registers none: tests/jobs/test_cli.py)
    def end() -> None:
        from pipeline.generate import stopping

        stopping.exit_now(code[0])  # the logs and streams flushed

    atexit.register(end)
    try:
        code[0] = main()
    except SystemExit as e:  # argparse's exit 2, --help's 0
        code[0] = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    sys.exit(code[0])


if __name__ == "__main__":
    entry()
