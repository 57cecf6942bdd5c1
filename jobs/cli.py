"""The ``promptmill`` command: parse flags, set up logs, call one library function.

Flags a subcommand does not know are passed to Beam as PipelineOptions (plan, collect
and run), e.g. ``--runner DirectRunner --direct_num_workers 2``.
"""
from __future__ import annotations

import argparse
import sys

from pipeline.core.choices import DTYPES, FORMATS, IMAGE_FORMATS, SCHEDULERS, parse_formats
from pipeline.core.settings import Settings

_DEFAULTS = Settings()


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    parser.add_argument("--prompts", default=d.prompts,
                        help="prompt file, folder, glob or gs:// path; formats by extension: .jsonl, .json, .txt, "
                             ".csv, .tsv, .parquet, each optionally .gz (default: %(default)s)")
    parser.add_argument("--prompt-field", default=d.prompt_field,
                        help="the prompt's column or key in jsonl, json, csv, tsv and parquet files; a .txt line is "
                             "a prompt (default: %(default)s)")
    parser.add_argument("--dedupe", action="store_true",
                        help="reject a record whose prompt an earlier record (in file and line order) already has, "
                             "as duplicate_prompt; counted in the stats")
    parser.add_argument("--out", default=d.out, help="output folder or gs://bucket/prefix (default: %(default)s)")
    parser.add_argument("--model", default=d.model,
                        help="diffusers-format checkpoint folder, or 'tiny' (a tiny random model whose images "
                             "are noise, for tests and demos) (default: %(default)s)")
    parser.add_argument("--width", type=int, default=None, help="image width, a multiple of 8 (default: the model's)")
    parser.add_argument("--height", type=int, default=None, help="image height, a multiple of 8 (default: the model's)")
    parser.add_argument("--steps", type=int, default=d.steps, help="denoising steps (default: %(default)s)")
    parser.add_argument("--scheduler", choices=list(SCHEDULERS), default=None,
                        help="sampling algorithm (default: the checkpoint's own)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=d.dtype,
                        help="network weights and compute dtype; latents stay float32 (default: %(default)s)")
    parser.add_argument("--format", default=",".join(d.formats),
                        help=f"output formats, comma-separated: {', '.join(FORMATS)} (default: %(default)s)")
    parser.add_argument("--image-format", choices=list(IMAGE_FORMATS), default=d.image_format,
                        help="image encoding (default: %(default)s)")
    parser.add_argument("--quality", type=int, default=d.quality,
                        help="jpeg and webp quality, 1-100 (default: %(default)s)")
    parser.add_argument("--save-latents", action="store_true",
                        help="with --format zarr: also write each image's final latents (float32, before VAE "
                             "decoding) to OUT/zarr/latents")
    parser.add_argument("--guidance-scale", type=float, default=d.guidance_scale,
                        help="classifier-free guidance scale for records without one (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed,
                        help="run seed, hashed with a record's id when the record has no seed (default: %(default)s)")
    parser.add_argument("--per-device-batch", type=int, default=d.per_device_batch,
                        help="images per device per step (default: %(default)s)")
    parser.add_argument("--batches-per-slice", type=int, default=d.batches_per_slice,
                        help="device steps per slice; slice size = devices per host x per-device batch x this "
                             "(default: %(default)s)")


def _settings(args, devices_per_host: int) -> Settings:
    return Settings(prompts=args.prompts, out=args.out, model=args.model, width=args.width, height=args.height,
                    steps=args.steps, scheduler=args.scheduler, dtype=args.dtype, formats=parse_formats(args.format),
                    image_format=args.image_format, quality=args.quality, guidance_scale=args.guidance_scale,
                    seed=args.seed, per_device_batch=args.per_device_batch,
                    batches_per_slice=args.batches_per_slice, devices_per_host=devices_per_host,
                    save_latents=args.save_latents, prompt_field=args.prompt_field, dedupe=args.dedupe)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="promptmill", description="Generate image datasets from text prompts "
                                     "with Stable Diffusion in JAX/Flax, on TPU pods or local CPU devices.")
    sub = parser.add_subparsers(dest="command", required=True)
    dated = []

    run = sub.add_parser("run", help="plan, generate on local host processes, and collect")
    dated.append(run)
    _add_settings_flags(run)
    run.add_argument("--engine", choices=("pod", "beam"), default="pod",
                     help="pod: plan, then --hosts local host processes (jax.distributed), then collect; beam: the "
                          "whole job as one Beam pipeline (the DirectRunner unless --runner says otherwise) whose "
                          "workers each generate on --devices-per-host local devices, as on Dataflow "
                          "(default: %(default)s)")
    run.add_argument("--hosts", type=int, default=None,
                     help="local host processes, with --engine pod (default: 2)")
    run.add_argument("--devices-per-host", type=int, default=2, help="CPU devices per host (default: %(default)s)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_overwrite_flag(run)
    _add_compile_cache_flag(run)

    plan = sub.add_parser("plan", help="validate prompts and cut them into slices (Beam)")
    dated.append(plan)
    _add_settings_flags(plan)
    plan.add_argument("--devices-per-host", type=int, default=1,
                      help="devices of each generate host; sets the slice size (default: %(default)s)")
    _add_overwrite_flag(plan)

    gen = sub.add_parser("generate", help="generate this host's slices (one process per host)")
    dated.append(gen)
    gen.add_argument("--out", required=True, help="the planned output folder or gs:// prefix")
    gen.add_argument("--coordinator", help="HOST:PORT of host 0's coordinator (omit on Cloud TPU / GKE)")
    gen.add_argument("--num-hosts", type=int, help="number of host processes (omit on Cloud TPU / GKE)")
    gen.add_argument("--host-id", type=int, help="this host's index (omit on Cloud TPU / GKE)")
    _add_compile_cache_flag(gen)

    collect = sub.add_parser("collect", help="merge and verify the outputs into OUT/dataset (Beam)")
    dated.append(collect)
    collect.add_argument("--out", required=True, help="the output folder or gs:// prefix")
    collect.add_argument("--gallery-page-size", type=int, default=100,
                         help="thumbnails per page of dataset/index.html and dataset/gallery/ (default: %(default)s)")

    reproduce = sub.add_parser("reproduce", help="regenerate images from their metadata rows and check their sha256")
    dated.append(reproduce)
    reproduce.add_argument("keys", nargs="+", metavar="KEY", help="image keys (the metadata's 'key' column)")
    reproduce.add_argument("--out", required=True, help="the run's output folder or gs:// prefix")
    reproduce.add_argument("--save", metavar="DIR", help="also write the regenerated images here as KEY.EXT")

    for command in dated:
        _add_date_flag(command)

    from jobs.submit import add_submit_parser

    add_submit_parser(sub, _add_settings_flags, _add_date_flag)  # submit dataflow|gke, with its own --date

    bench = sub.add_parser("bench", help="benchmarks")
    targets = bench.add_subparsers(dest="target", required=True)
    _add_bench_generator_flags(targets.add_parser(
        "generator", help="images/s, FLOP/s and start-up of the generator, against the seed notebook's recipe"))
    upload = targets.add_parser("upload", help="objects/s and MB/s to a local GCS emulator, N parallel uploads vs 1")
    upload.add_argument("--objects", type=int, default=200, help="objects per measurement (default: %(default)s)")
    upload.add_argument("--object-bytes", type=int, default=100_000, help="bytes per object (default: %(default)s)")
    upload.add_argument("--parallel", type=_batch_sizes, default=(1, 4, 16),
                        help="comma-separated worker counts (default: 1,4,16)")
    upload.add_argument("--latency-ms", type=_latencies_ms, default=(0.0,),
                        help="comma-separated latencies added to each request by a proxy in front of the emulator, "
                             "each measured with every --parallel, e.g. 0,20 (default: 0, no proxy)")
    upload.add_argument("--repeats", type=int, default=1,
                        help="run the whole grid this many times, in turns; rates are the medians (default: 1)")
    upload.add_argument("--report", help="write the JSON report here")
    plan_bench = targets.add_parser("plan", help="wall time and peak RSS of `plan` on synthetic prompt shards, "
                                    "against the RSS of holding every prompt in memory at once")
    plan_bench.add_argument("--prompts", type=int, default=1_000_000, help="prompts in all (default: %(default)s)")
    plan_bench.add_argument("--shards", type=int, default=100, help="jsonl files (default: %(default)s)")
    plan_bench.add_argument("--workdir", help="folder for the prompts, the plan and its logs, kept after the run "
                            "(default: a temporary folder, deleted after)")
    plan_bench.add_argument("--devices-per-host", type=int, default=4, help="plan flag (default: %(default)s)")
    plan_bench.add_argument("--per-device-batch", type=int, default=8, help="plan flag (default: %(default)s)")
    plan_bench.add_argument("--batches-per-slice", type=int, default=32, help="plan flag (default: %(default)s)")
    plan_bench.add_argument("--beam-args", default="", help="Beam options for the plan, one quoted string, e.g. "
                            "'--direct_num_workers 2 --direct_running_mode multi_processing' (default: none)")
    plan_bench.add_argument("--report", "--json", dest="report", help="write the JSON report here")
    pipe = targets.add_parser("pipeline", help="images/s of the generator alone, the full host pipeline (local "
                              "disk, GCS emulator) and the seed's sequential loop, on the same slices")
    pipe.add_argument("--generator", choices=("synthetic", "tiny"), default="synthetic",
                      help="synthetic: a stand-in device, --seconds-per-batch per step; tiny: the tiny random "
                           "model (default: %(default)s)")
    pipe.add_argument("--width", type=int, default=None, help="image width (default: 512, tiny: the model's)")
    pipe.add_argument("--height", type=int, default=None, help="image height (default: 512, tiny: the model's)")
    pipe.add_argument("--batch", type=int, default=8, help="images per device step (default: %(default)s)")
    pipe.add_argument("--seconds-per-batch", type=float, default=1.0,
                      help="synthetic: seconds per device step (default: %(default)s)")
    pipe.add_argument("--steps", type=int, default=2, help="tiny: denoising steps (default: %(default)s)")
    pipe.add_argument("--slices", type=int, default=4, help="slices per mode (default: %(default)s)")
    pipe.add_argument("--batches-per-slice", type=int, default=2, help="device steps per slice (default: %(default)s)")
    pipe.add_argument("--gcs", action="store_true", help="also run the pipeline to a local GCS emulator")
    pipe.add_argument("--modes", default="generator,pipeline,sequential",
                      help="which loops to run, comma-separated: generator (a), pipeline (b), sequential (c) "
                           "(default: %(default)s)")
    pipe.add_argument("--workdir", help="folder for the outputs, kept after the run (default: a temporary folder)")
    pipe.add_argument("--report", help="write the JSON report here")
    return parser


def _add_date_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--date", help="the run's scheduled date (YYYY-MM-DD or an RFC 3339 time), put in place of "
                        "{date} in --out: a scheduled run re-triggered for the same date resumes it")


def _add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="delete what an earlier run wrote under --out and start over (without it, re-running "
                             "the same settings resumes, and other settings are refused)")


def _add_compile_cache_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="JAX persistent compilation cache folder: hosts load the compiled sampler from it "
                             "instead of compiling when it is there (local folder; not part of the run's settings)")


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _latencies_ms(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"latencies must be >= 0, got {text!r}")
    return values


def _add_bench_generator_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="SD 1.x/2.x checkpoint with Flax weights (the seed recipe loads it too), or a "
                             "built-in random model: tiny, random-sd15 (default: %(default)s)")
    parser.add_argument("--width", type=int, default=None, help="image width (default: the model's)")
    parser.add_argument("--height", type=int, default=None, help="image height (default: the model's)")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default: %(default)s)")
    parser.add_argument("--per-device-batch", type=_batch_sizes, default=(1,), metavar="B[,B...]",
                        help="per-device batch sizes to sweep, e.g. 1,2,4 (default: 1)")
    parser.add_argument("--batches", type=int, default=2, help="timed batches per size, after one warm-up batch "
                        "(default: %(default)s)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weights and compute dtype "
                        "(default: %(default)s)")
    parser.add_argument("--devices", type=int, default=None, help="use the first N local devices (default: all)")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="side of the square matmul that measures the peak (default: 4096 on CPU, else 8192)")
    parser.add_argument("--report", help="write the JSON report here (local path or gs://)")


def main(argv: list[str] | None = None) -> int:
    from pipeline.core import logs

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command in ("generate", "bench"):
        parser.error(f"unrecognized arguments for {args.command}: {' '.join(extra)}")
    logs.setup()
    try:
        if hasattr(args, "date"):
            from pipeline.cloud import dates as schedule

            args.out = schedule.resolve_out(args.out, args.date)
        return _dispatch(args, extra)
    except KeyboardInterrupt:
        print("promptmill: interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError) as e:
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

    if args.command == "run":
        settings = _settings(args, args.devices_per_host)
        if args.engine == "beam":
            from pipeline.engines import beam as beam_engine

            if args.hosts is not None:
                raise ValueError("--hosts is for --engine pod; with --engine beam each Beam worker generates on "
                                 "its own --devices-per-host devices")
            if args.compile_cache:
                raise ValueError("--compile-cache works with --engine pod only")
            stats = beam_engine.run_beam(settings, beam_args, overwrite=args.overwrite)
        else:
            from pipeline.engines import local as launcher

            stats = launcher.run_local(settings, 2 if args.hosts is None else args.hosts, beam_args,
                                       progress=not args.no_progress, compile_cache=args.compile_cache,
                                       overwrite=args.overwrite)
        print(json.dumps({k: stats[k] for k in ("images", "records", "rejects", "verified")}))
    elif args.command == "plan":
        from pipeline.plan import transforms as plan

        print(json.dumps(plan.run_plan(_settings(args, args.devices_per_host), beam_args, args.overwrite)))
    elif args.command == "generate":
        from pipeline.generate import cluster
        from pipeline.generate import host_loop as host

        host.generate(args.out, cluster.ClusterArgs(args.coordinator, args.num_hosts, args.host_id),
                      compile_cache=args.compile_cache)
    elif args.command == "collect":
        from pipeline.collect import transforms as collect

        stats = collect.run_collect(args.out, beam_args, page_size=args.gallery_page_size)
        print(json.dumps({k: stats[k] for k in ("images", "records", "rejects", "verified")}))
    elif args.command == "reproduce":
        from pipeline.generate import reproduce

        if beam_args:
            raise ValueError(f"unrecognized arguments: {' '.join(beam_args)}")
        results = reproduce.reproduce(args.out, args.keys, save=args.save,
                                      emit=lambda result: print(json.dumps(result), flush=True))
        mismatched = [r["key"] for r in results if not r["match"]]
        if mismatched:
            print(f"promptmill reproduce: {len(mismatched)} of {len(results)} image(s) differ from their metadata's "
                  f"sha256: {', '.join(mismatched)}", file=sys.stderr)
            return 1
    elif args.command == "bench" and args.target == "upload":
        from pipeline.io import storage
        from pipeline.bench import upload as upload_bench

        report = upload_bench.run(args.objects, args.object_bytes, args.parallel, args.latency_ms, args.repeats)
        if args.report:
            storage.write_json(args.report, report)
        print(upload_bench.table(report))
    elif args.command == "bench" and args.target == "plan":
        import shlex

        from pipeline.bench import plan as plan_bench
        from pipeline.io import storage

        report = plan_bench.run(args.prompts, args.shards, args.workdir, args.devices_per_host,
                                args.per_device_batch, args.batches_per_slice, shlex.split(args.beam_args))
        if args.report:
            storage.write_json(args.report, report)
        print(plan_bench.table(report))
    elif args.command == "submit":
        from jobs.submit import run_submit

        return run_submit(args, beam_args)
    elif args.command == "bench" and args.target == "pipeline":
        from pipeline.bench import host_loop as pipeline_bench

        report = pipeline_bench.run(pipeline_bench.PipelineBenchConfig(
            generator=args.generator, width=args.width, height=args.height, batch=args.batch,
            seconds_per_batch=args.seconds_per_batch, slices=args.slices, batches_per_slice=args.batches_per_slice,
            steps=args.steps, gcs=args.gcs, modes=tuple(m for m in args.modes.split(",") if m),
            workdir=args.workdir, report=args.report))
        print(pipeline_bench.table(report))
    elif args.command == "bench":
        from pipeline.bench import generator as bench

        config = bench.BenchConfig(model=args.model, width=args.width, height=args.height, steps=args.steps,
                                   per_device_batches=args.per_device_batch, batches=args.batches, dtype=args.dtype,
                                   devices=args.devices, matmul_size=args.matmul_size, report=args.report)
        report = bench.run_bench(config)
        print(bench.format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
