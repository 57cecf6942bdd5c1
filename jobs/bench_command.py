"""``promptmill bench generator|upload|plan|collect|status|pipeline|tpu|sizes``: the benchmarks' flags and
the call into ``pipeline.bench``.

jobs/cli.py adds the parser with ``add_bench_parser`` and dispatches to ``run_bench``.
"""
from __future__ import annotations

import argparse

from jobs import flags, strict
from pipeline.bench.throughput_config import DEFAULT_PARTS, GUIDANCE, BenchConfig
from pipeline.core.choices import DTYPES, SCHEDULERS, TIMESTEP_SPACINGS
from pipeline.core.settings import AUTO


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """Add ``bench`` with its targets to ``sub`` (the CLI's subparsers)."""
    bench = sub.add_parser("bench", help="benchmarks")
    targets = bench.add_subparsers(dest="target", required=True)
    generator = targets.add_parser(
        "generator", help="images/s, FLOP/s and start-up of the generator, against the seed notebook's recipe")
    _add_bench_generator_flags(generator)
    strict.strict(generator)
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
    strict.strict(upload)
    plan_bench = targets.add_parser("plan", help="wall time and peak RSS of `plan` on synthetic prompt shards, "
                                    "against the RSS of holding every prompt in memory at once")
    plan_bench.add_argument("--prompts", type=_batch_sizes, default=(1_000_000,), metavar="N[,N...]",
                            help="prompts in all; several sizes, comma-separated, run one after the other and give "
                                 "the peak's growth per record between them (default: 1000000)")
    plan_bench.add_argument("--shards", type=int, default=100, help="jsonl files (default: %(default)s)")
    plan_bench.add_argument("--workdir", help="folder for the prompts, the plan and its logs, kept after the run "
                            "(default: a temporary folder, deleted after)")
    plan_bench.add_argument("--devices-per-host", type=int, default=4, help="plan flag (default: %(default)s)")
    plan_bench.add_argument("--per-device-batch", type=int, default=8, help="plan flag (default: %(default)s)")
    plan_bench.add_argument("--batches-per-slice", type=int, default=32, help="plan flag (default: %(default)s)")
    plan_bench.add_argument("--beam-args", default="", help="Beam options for the plan, one quoted string, e.g. "
                            "'--direct_num_workers 2 --direct_running_mode multi_processing' (default: none)")
    plan_bench.add_argument("--dedupe", action="store_true", help="plan with --dedupe")
    plan_bench.add_argument("--duplicates", type=float, default=0.0, metavar="SHARE",
                            help="the share of rows that repeat an earlier row's id, e.g. 0.1 (default: none)")
    plan_bench.add_argument("--hold", choices=("auto", "yes", "no"), default="auto",
                            help="also measure a process holding every prompt (auto: up to 1,000,000 prompts)")
    plan_bench.add_argument("--again", action="store_true",
                            help="then run the same plan again on the finished plan: timed, and no plan object may "
                                 "be written again")
    plan_bench.add_argument("--reference", metavar="ROOT",
                            help="another promptmill checkout (an earlier version) that plans the same input right "
                                 "after, measured alike: its plan/ bytes must be the same")
    plan_bench.add_argument("--report", "--json", dest="report", help="write the JSON report here")
    strict.strict(plan_bench, beam_strings=("--beam-args",))
    collect_bench = targets.add_parser("collect", help="collect, reproduce's look-up of random keys and status on a "
                                       "fabricated committed run of --images (no model): seconds, peak RSS, bytes "
                                       "read, objects written per image, and write operations at a billion images")
    collect_bench.add_argument("--images", type=int, default=100_000, help="images of the run (default: %(default)s)")
    collect_bench.add_argument("--slice-size", type=int, default=1024, help="images a slice (default: %(default)s)")
    collect_bench.add_argument("--hosts", type=int, default=4, help="hosts the slices are spread over "
                               "(default: %(default)s)")
    collect_bench.add_argument("--format", default="files", help="the run's --format (default: %(default)s)")
    collect_bench.add_argument("--lookups", type=int, default=100, help="random keys looked up "
                               "(default: %(default)s)")
    collect_bench.add_argument("--part-rows", type=int, default=None, help="collect's --part-rows (default: its own)")
    collect_bench.add_argument("--workdir", help="where the run is made, kept after (default: a temporary folder, "
                               "deleted after)")
    collect_bench.add_argument("--report", help="write the JSON report here")
    strict.strict(collect_bench)
    tpu = targets.add_parser("tpu", help="compile the host program for TPU chips here, without a TPU (libtpu): "
                             "memory per chip, whether it fits, FLOPs, attention kernels and compile time, over "
                             "per-device batches, attention implementations, TPU types and sizes")
    tpu.add_argument("--model", default="tiny", help="checkpoint or built-in model (its shapes only: "
                     "random-sd15, random-sdxl and the like need no weights) (default: %(default)s)")
    tpu.add_argument("--sizes", type=_batch_sizes, default=(None,), metavar="N[,N...]",
                     help="square image sizes (default: the model's own)")
    tpu.add_argument("--steps", type=int, default=20, help="denoising steps (default: %(default)s)")
    tpu.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="(default: %(default)s)")
    tpu.add_argument("--per-device-batch", type=_batches_or_auto, default=(1,), metavar="B[,B...]|auto",
                     help="images per chip to compile, or auto: the largest that fits each target (default: 1)")
    tpu.add_argument("--attentions", default="auto", help="attention implementations, comma-separated "
                     "(default: %(default)s)")
    tpu.add_argument("--fsdp", type=_batches_or_auto, default=(1,), metavar="N[,N...]|auto",
                     help="FSDP degrees to compile (those a target's host cannot have are skipped), or auto: the "
                          "smallest that fits each target (default: 1)")
    tpu.add_argument("--targets", default="v5e:2x2", help="TPU hosts to compile for, TYPE:TOPOLOGY[:MACHINE_TYPE], "
                     "comma-separated, from the TPU table (default: %(default)s)")
    tpu.add_argument("--guidance-scale", type=float, default=None,
                     help="above 1 the guided program of SD and SDXL (the UNet at twice the rows) (default: the "
                          "model family's)")
    tpu.add_argument("--scorers", choices=("random", "tiny"), default=None,
                     help="compile the scoring program too, with every score by these scorers: random (CLIP ViT-L/14, "
                          "SD's safety checker and LAION's head at their real sizes, shapes only) or tiny; the total is "
                          "what the sampler and the scorer need together (default: no scores)")
    tpu.add_argument("--report", help="write the JSON report here")
    strict.strict(tpu)
    status_bench = targets.add_parser("status", help="what `promptmill status` and a starting host read, and "
                                      "their seconds, on runs of many committed slices, from the hosts' ledgers and "
                                      "from a listing of the markers")
    status_bench.add_argument("--committed-slices", type=_batch_sizes, default=(10_000, 100_000, 1_000_000),
                              metavar="N[,N...]", help="committed slices of each run (default: 10000,100000,1000000)")
    status_bench.add_argument("--hosts", type=int, default=16, help="pod hosts of each run (default: %(default)s)")
    status_bench.add_argument("--repeats", type=int, default=3, help="status runs per measurement "
                              "(default: %(default)s)")
    status_bench.add_argument("--workdir", help="where the runs are written, kept after (default: a temporary "
                              "folder)")
    status_bench.add_argument("--gcs-up-to", type=int, default=0, metavar="N",
                              help="also time status on a GCS emulator for the runs of at most N slices (default: "
                                   "none)")
    status_bench.add_argument("--report", help="write the JSON report here")
    strict.strict(status_bench)
    sizes = targets.add_parser("sizes", help="one run of several sizes against one single-size run per size, of "
                               "the same records: images/s, and the devices' idle time at each size switch")
    sizes.add_argument("--model", default="tiny", help="(default: %(default)s)")
    sizes.add_argument("--sizes", type=flags.sizes_flag, default=("64x64", "48x64", "64x48"), metavar="WxH,...",
                       help="(default: 64x64,48x64,64x48)")
    sizes.add_argument("--records", type=int, default=24, help="records per size (default: %(default)s)")
    sizes.add_argument("--steps", type=int, default=None,
                       help="(default: the model's own, as a run takes it: 20 for tiny)")
    sizes.add_argument("--hosts", type=int, default=2, help="(default: %(default)s)")
    sizes.add_argument("--devices-per-host", type=int, default=2, help="(default: %(default)s)")
    sizes.add_argument("--per-device-batch", type=int, default=2, help="(default: %(default)s)")
    sizes.add_argument("--batches-per-slice", type=int, default=2, help="(default: %(default)s)")
    sizes.add_argument("--workdir", help="folder for the runs, kept after (default: a temporary folder)")
    sizes.add_argument("--report", help="write the JSON report here")
    strict.strict(sizes)
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
    strict.strict(pipe)
    return bench


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _flops_recipes(text: str) -> tuple:
    recipes = []
    for part in text.split(","):
        try:
            model, steps, guidance = part.split(":")
            recipes.append((model, int(steps), float(guidance)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected MODEL:STEPS:GUIDANCE, comma-separated, got {part!r}") from None
    return tuple(recipes)


def _batches_or_auto(text: str) -> tuple:
    if text == AUTO:
        return (AUTO,)
    return _batch_sizes(text)


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
    parser.add_argument("--guidance-scale", type=float, default=GUIDANCE,
                        help="guidance of the sweep; at <= 1 it runs the guidance-free program (default: %(default)s)")
    parser.add_argument("--scheduler", choices=list(SCHEDULERS), default=None,
                        help="sampler of the sweep and of the compared recipes (default: the checkpoint's own)")
    parser.add_argument("--timestep-spacing", choices=list(TIMESTEP_SPACINGS), default=None,
                        help="timestep spacing of the sweep and the recipes (default: the checkpoint's own)")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                        help="which parts to run, comma-separated: flops (FLOPs per image by part of --flops-recipes, "
                             "from shapes alone: no weights), sweep (ours and the seed notebook's recipe: needs the "
                             "notebook extra, pip install 'promptmill[notebook]'), recipes "
                             "(guidance-free, few-step and default side by side), scoring (images/s with and without "
                             "--score clip,aesthetic,safety side by side, at --steps with CFG and 1-step "
                             "guidance-free), attention (each of --attentions "
                             "side by side: speed, memory, kernels), memory (the sampler's memory at each of "
                             "--memory-sizes with each of --attentions, from shapes), startup, fsdp (images/s at "
                             "each --fsdp degree side by side), models (--model and --compare-models side by side) (default: %(default)s)")
    parser.add_argument("--attentions", default=",".join(BenchConfig.attentions),
                        help="attention implementations compared by the attention and memory parts, the first "
                             "the reference (default: %(default)s)")
    parser.add_argument("--memory-sizes", type=_batch_sizes, default=BenchConfig.memory_sizes,
                        help="square image sizes of the memory part, comma-separated (default: 512,1024)")
    parser.add_argument("--fsdp", type=_batch_sizes, default=BenchConfig.fsdps, metavar="N[,N...]",
                        help="the fsdp part's FSDP degrees, timed side by side (default: 1,2)")
    parser.add_argument("--flops-recipes", type=_flops_recipes, default=None, metavar="MODEL:STEPS:GUIDANCE[,...]",
                        help="the flops part's recipes, costed from shapes alone at --width x --height (default "
                             "1024x1024): default random-flux:4:0,random-flux-dev:28:3.5,random-sdxl:4:0,"
                             "random-sdxl:20:7.5 (FLUX.1 [schnell] and [dev], SDXL-Lightning's 4 steps, SDXL's "
                             "default)")
    parser.add_argument("--compare-models", default="", metavar="MODEL[,MODEL...]",
                        help="the models part: models timed side by side with --model at its size and steps, each "
                             "at its family's default guidance (default: none)")
    parser.add_argument("--startup-against", metavar="DIR",
                        help="the startup part: another promptmill source tree (a checkout of an earlier commit) "
                             "whose start-up is timed in turns with this one's, cold and warm, side by side "
                             "(default: none)")
    parser.add_argument("--decode-batch", type=_decode_batch, default=BenchConfig.decode_batch, metavar="N|whole",
                        help="images the VAE decodes at once in every sampler timed, as a run's --decode-batch; "
                             "whole: the whole per-device batch, as runs planned before it (default: %(default)s, a "
                             "new run's)")
    parser.add_argument("--scorers", choices=("random", "tiny"), default="random",
                        help="the scoring part's scorers: random (CLIP ViT-L/14, SD's safety checker and LAION's head "
                             "at their real sizes, random weights) or tiny (default: %(default)s)")
    parser.add_argument("--report", help="write the JSON report here (local path or gs://)")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.target`` and print its table (and write its report with ``--report``)."""
    if args.target == "upload":
        from pipeline.bench import upload as upload_bench
        from pipeline.io import storage

        report = upload_bench.run(args.objects, args.object_bytes, args.parallel, args.latency_ms, args.repeats)
        if args.report:
            storage.write_json(args.report, report)
        print(upload_bench.table(report))
    elif args.target == "plan":
        import shlex

        from pipeline.bench import plan_scale as plan_bench
        from pipeline.io import storage

        options = dict(shards=args.shards, devices_per_host=args.devices_per_host,
                       per_device_batch=args.per_device_batch, batches_per_slice=args.batches_per_slice,
                       beam_args=shlex.split(args.beam_args), dedupe=args.dedupe, duplicates=args.duplicates,
                       hold={"auto": None, "yes": True, "no": False}[args.hold], again=args.again,
                       reference=args.reference)
        if len(args.prompts) == 1:
            report = plan_bench.run(args.prompts[0], workdir=args.workdir, **options)
        else:
            report = plan_bench.sweep(list(args.prompts), args.workdir, **options)
        if args.report:
            storage.write_json(args.report, report)
        print(plan_bench.table(report))
    elif args.target == "tpu":
        from pipeline.bench import tpu_fit as tpu_bench
        from pipeline.io import storage

        report = tpu_bench.run(tpu_bench.TpuBenchConfig(
            model=args.model, sizes=args.sizes, steps=args.steps, dtype=args.dtype,
            per_device_batches=args.per_device_batch, attentions=tuple(a for a in args.attentions.split(",") if a),
            fsdps=args.fsdp, targets=tuple(tpu_bench.parse_target(t) for t in args.targets.split(",") if t),
            guidance_scale=args.guidance_scale, scorers=args.scorers, report=args.report))
        if args.report:
            storage.write_json(args.report, report)
        print(tpu_bench.table(report))
    elif args.target == "collect":
        from pipeline.bench import collect_scale
        from pipeline.core.choices import parse_formats
        from pipeline.io import storage

        report = collect_scale.run(args.images, args.workdir, args.slice_size, args.hosts, parse_formats(args.format),
                                   lookups=args.lookups, part_rows=args.part_rows)
        if args.report:
            storage.write_json(args.report, report)
        print(collect_scale.table(report))
    elif args.target == "status":
        from pipeline.bench import status_scale as status_bench
        from pipeline.io import storage

        report = status_bench.run(args.committed_slices, args.hosts, args.repeats, args.workdir, args.gcs_up_to)
        if args.report:
            storage.write_json(args.report, report)
        print(status_bench.table(report))
    elif args.target == "sizes":
        from pipeline.bench import sizes as sizes_bench

        report = sizes_bench.run(sizes_bench.SizesBenchConfig(
            model=args.model, sizes=args.sizes, records=args.records, steps=args.steps, hosts=args.hosts,
            devices_per_host=args.devices_per_host, per_device_batch=args.per_device_batch,
            batches_per_slice=args.batches_per_slice, workdir=args.workdir, report=args.report))
        print(sizes_bench.table(report))
    elif args.target == "pipeline":
        from pipeline.bench import host_overhead as pipeline_bench

        report = pipeline_bench.run(pipeline_bench.PipelineBenchConfig(
            generator=args.generator, width=args.width, height=args.height, batch=args.batch,
            seconds_per_batch=args.seconds_per_batch, slices=args.slices, batches_per_slice=args.batches_per_slice,
            steps=args.steps, gcs=args.gcs, modes=tuple(m for m in args.modes.split(",") if m),
            workdir=args.workdir, report=args.report))
        print(pipeline_bench.table(report))
    else:
        from pipeline.bench import throughput, throughput_table

        config = BenchConfig(model=args.model, width=args.width, height=args.height, steps=args.steps,
                                   per_device_batches=args.per_device_batch, batches=args.batches, dtype=args.dtype,
                                   devices=args.devices, matmul_size=args.matmul_size, report=args.report,
                                   guidance_scale=args.guidance_scale, scheduler=args.scheduler,
                                   timestep_spacing=args.timestep_spacing,
                                   parts=tuple(p for p in args.parts.split(",") if p),
                                   compare_models=tuple(m for m in args.compare_models.split(",") if m),
                                   attentions=tuple(a for a in args.attentions.split(",") if a),
                                   memory_sizes=args.memory_sizes, fsdps=args.fsdp, scorers=args.scorers,
                                   decode_batch=args.decode_batch, startup_against=args.startup_against,
                                   **({"flops_recipes": args.flops_recipes} if args.flops_recipes else {}))
        report = throughput.run_bench(config)
        print(throughput_table.format_table(report))
    return 0


def _decode_batch(text: str) -> int | None:
    """``bench generator --decode-batch``: a whole number, or whole (None)."""
    if text == "whole":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or whole, got {text!r}") from None
