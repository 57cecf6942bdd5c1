"""The ``promptmill`` command: parse flags, set up logs, call one library function.

Flags a subcommand does not know are passed to Beam as PipelineOptions (run, plan, collect
and submit), e.g. ``--runner DirectRunner --direct_num_workers 2``, if Beam knows them; any
other unknown flag is an error that names the closest known one (``jobs.flags.check_extra``).
No flag is abbreviated, and a flag that takes one value given twice is an error
(``jobs.flags.Parser``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from pipeline.core import logs

logs.drop_beams_apitools_warning()  # before anything imports Beam

from jobs import flags  # noqa: E402
from jobs.bench_command import add_bench_parser, run_bench  # noqa: E402
from jobs.flags import add_compile_cache_flag, add_date_flag, add_overwrite_flag, add_settings_flags  # noqa: E402
from jobs.submit_command import SUMMARY, add_submit_parser, run_submit  # noqa: E402
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
                          f"repeats).")
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
    gen.add_argument("--out", required=True, help="the planned output folder or gs:// prefix")
    gen.add_argument("--coordinator", help="HOST:PORT of host 0's coordinator (omit on Cloud TPU / GKE)")
    gen.add_argument("--num-hosts", type=int, help="number of host processes (omit on Cloud TPU / GKE)")
    gen.add_argument("--host-id", type=int, help="this host's index (omit on Cloud TPU / GKE)")
    add_compile_cache_flag(gen)

    collect = sub.add_parser("collect", help="merge and verify the outputs into OUT/dataset (Beam)")
    dated.append(collect)
    collect.add_argument("--out", required=True, help="the output folder or gs:// prefix")
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

    for command in (run, plan, collect):
        flags.strict(command, beam=True)  # flags they do not know may be Beam options
    for command in (gen, reproduce):
        flags.strict(command)

    status = sub.add_parser("status", help="where a run stands: slices and images committed, rate and ETA, "
                            "hosts, collect (reads no image and no metadata shard)")
    status.add_argument("out", metavar="OUT", nargs="?", help="the run's output folder or gs:// prefix (or --out)")
    status.add_argument("--out", dest="out_flag", metavar="OUT", help="the same as the positional OUT, as the other "
                        "commands take it")
    status.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    status.add_argument("--watch", type=float, metavar="N", help="print it again every N seconds, until Ctrl-C")
    flags.strict(status)

    add_submit_parser(sub)  # submit dataflow|gke, with its own --date
    add_bench_parser(sub)  # bench generator|upload|plan|status|pipeline|tpu
    for command in _commands(parser):
        command.add_argument("--log-level", choices=list(logs.LEVELS), default="info",
                             help="the least important JSON log events shown on stderr (default: %(default)s)")
        command.add_argument("--quiet", action="store_true",
                             help="warnings and errors only: no info events, no progress bar, no summary")
    return parser


def _commands(parser) -> list:
    """The parsers that run something: every subcommand, and every target of one that has them."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                nested = [a for a in child._actions if isinstance(a, argparse._SubParsersAction)]
                found += _commands(child) if nested else [child]
    return found


def summary(command: str, out: str, stats: dict, seconds: float) -> str:
    """What a finished run or collect says to people (stderr; the JSON line on stdout is
    for scripts): images written, dropped and rejected, where the rejects and the dataset
    are, wall time and images/s, and what to run next."""
    dropped = (stats.get("dropped") or {}).get("images", 0)
    rejects = stats.get("rejects", 0)
    rate = f", {stats['images'] / seconds:.2f} images/s" if seconds > 0 and stats.get("images") else ""
    lines = [f"promptmill {command}: {stats['images']} image(s) written, {dropped} dropped by filters, {rejects} input "
             f"row(s) rejected{' (OUT/plan/rejects/)' if rejects else ''}; {'verified' if stats.get('verified') else 'NOT verified'}",
             f"  {seconds:.1f} s{rate}",
             f"  dataset: {out.rstrip('/')}/ (its card README.md; dataset/metadata.parquet, stats.json, index.html)",
             f"  next: promptmill status {out}  |  promptmill reproduce KEY --out {out}"]
    if rejects:
        lines[0] = lines[0].replace("OUT/", f"{out.rstrip('/')}/")
    return "\n".join(lines)


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

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    beam_args = flags.check_extra(args, extra)  # an unknown flag exits 2 here, before anything runs
    _cpu_only(args)
    logs.setup(logs.LEVELS["warning" if getattr(args, "quiet", False) else getattr(args, "log_level", "info")])
    try:
        if hasattr(args, "date"):
            from pipeline.cloud import dates as schedule

            args.out = schedule.resolve_out(args.out, args.date)
        with interrupts.raising():  # SIGTERM stops a command as Ctrl-C does: hosts and workers first
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


def _dispatch(args, beam_args: list[str]) -> int:
    import json

    started = time.perf_counter()
    if args.command == "run":
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
        print(json.dumps({k: stats[k] for k in SUMMARY}))
        if not args.quiet:
            print(summary("run", settings.out, stats, time.perf_counter() - started), file=sys.stderr)
    elif args.command == "plan":
        from pipeline.generate import fit
        from pipeline.plan import transforms as plan

        # tpu_check: --device-memory is kept in run.json, for a submission's check after its plan
        asked = flags.settings_from_args(args, args.devices_per_host, tpu_check=True)
        settings = fit.resolve_per_device_batch(asked, args.overwrite)
        print(json.dumps(plan.run_plan(settings, beam_args, args.overwrite,
                                       fit.cap_hosts(asked, args.hosts, args.overwrite))))
    elif args.command == "generate":
        from pipeline.generate import cluster, host_loop as host

        host.generate(args.out, cluster.ClusterArgs(args.coordinator, args.num_hosts, args.host_id),
                      compile_cache=args.compile_cache)
    elif args.command == "collect":
        from pipeline.collect import transforms as collect

        stats = collect.run_collect(args.out, beam_args, **flags.gallery_of(args))
        print(json.dumps({k: stats[k] for k in SUMMARY}))
        if not args.quiet:
            print(summary("collect", args.out, stats, time.perf_counter() - started), file=sys.stderr)
    elif args.command == "reproduce":
        from pipeline.generate import reproduce

        results = reproduce.reproduce(args.out, args.keys, save=args.save,
                                      emit=lambda result: print(json.dumps(result), flush=True))
        mismatched = [r["key"] for r in results if not r["match"]]
        if mismatched:
            print(f"promptmill reproduce: {len(mismatched)} of {len(results)} image(s) differ from their metadata's "
                  f"sha256: {', '.join(mismatched)}", file=sys.stderr)
            return 1
    elif args.command == "status":
        from pipeline.collect import status

        if args.out is None and args.out_flag is None:
            raise ValueError("status needs the run's OUT: positional or --out")
        if None not in (args.out, args.out_flag) and args.out != args.out_flag:
            raise ValueError(f"status takes one OUT, given two: {args.out} and --out {args.out_flag}")
        args.out = args.out or args.out_flag

        if args.watch is not None:
            status.watch(args.out, args.watch, args.json)
        else:
            report = status.status(args.out)
            print(json.dumps(report, sort_keys=True) if args.json else status.format_text(report))
    elif args.command == "submit":
        return run_submit(args, beam_args)
    elif args.command == "bench":
        return run_bench(args)
    return 0


def entry() -> None:
    """The ``promptmill`` command: ``main``, and the process ends with its exit code once
    every exit handler has run (JAX's shutdown, logging's, temporary folders'), without the
    interpreter's teardown of the libraries loaded (jax, Beam, flax, tensorstore):
    measured at 0.3 to 0.9 s per process on CPU after the work was done, on every host
    and every command. ``main`` itself returns, so it can be called in a process that goes on."""
    import atexit

    code = [1]  # an exception main let through: Python prints it, and the exit code is 1

    # registered first, so it runs after every other exit handler (importing this module
    # registers none: tests/test_cli.py)
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
