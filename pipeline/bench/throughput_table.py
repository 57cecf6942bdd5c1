"""``promptmill bench generator``'s report as a readable table: a section per part that ran.

Each section is a title, a header and a line a row, its cells right-aligned in columns
one space apart (``aligned``): the columns of each section are data below, with the
format of their cells.
"""
from __future__ import annotations

from pipeline.generate.fit import GIB

# the rows of the start-up table: (label, key of the probe's result)
STARTUP_ROWS = (("import", "import_s"), ("load weights, check files", "load_s"),
                ("transfer to devices", "transfer_s"),
                ("compile or deserialize (beside load and transfer)", "compile_s"),
                ("wait for the compile", "wait_s"), ("time to ready", "ready_s"),
                ("first batch", "first_batch_s"), ("fresh process in all", "total_s"))
# (title, width, format spec of the cells) of each section's columns
FLOPS_COLUMNS = (("model", 16, ""), ("steps", 5, ""), ("guidance", 8, ""), ("guided", 6, ""), ("text", 7, ".2f"),
                 ("denoiser call", 13, ".2f"), ("VAE decode", 10, ".2f"), ("per image", 9, ".1f"))
SWEEP_COLUMNS = (("per-dev batch", 13, ""), ("ours img/s", 11, ".4f"), ("seed img/s", 11, ".4f"),
                 ("ours/seed", 9, ".3f"), ("GFLOP/img", 10, ".2f"), ("GFLOP/s", 8, ".2f"), ("util", 6, ".1%"),
                 ("seed util", 9, ".1%"))
MODELS_COLUMNS = (("model", 18, ""), ("guidance", 8, ""), ("guided", 6, ""), ("img/s", 9, ".4f"),
                  ("GFLOP/img", 10, ".3f"), ("over first", 10, ".3f"))
RECIPES_COLUMNS = (("recipe", 16, ""), ("sampler", 8, ""), ("spacing", 9, ""), ("steps", 5, ""), ("guidance", 8, ""),
                   ("batch", 5, ""), ("img/s", 9, ".4f"), ("GFLOP/img", 10, ".2f"))
ATTENTION_COLUMNS = (("attention", 10, ""), ("img/s", 9, ".4f"), ("relative", 8, ".3f"), ("temp GiB", 9, ".3f"),
                     ("total GiB", 9, ".3f"))
MEMORY_COLUMNS = (("attention", 10, ""), ("size", 6, ""), ("temp GiB", 9, ".3f"), ("total GiB", 9, ".3f"))
SCORING_COLUMNS = (("recipe", 10, ""), ("steps", 5, ""), ("plain img/s", 11, ".4f"), ("scored img/s", 12, ".4f"),
                   ("overhead", 8, ".1%"), ("scorer/sampler FLOPs", 20, ".2%"))
STARTUP_COLUMNS = (("", 42, ""), ("cold", 8, ".2f"), ("warm", 8, ".2f"), ("warm/cold", 9, ""))
AGAINST_COLUMNS = (("", 42, ""), ("cold", 8, ".2f"), ("against", 8, ".2f"), ("warm", 8, ".2f"),
                   ("against", 8, ".2f"))
FSDP_COLUMNS = (("fsdp", 5, ""), ("img/s", 9, ".4f"), ("relative", 8, ".3f"), ("argument MiB/device", 19, ".2f"))


def aligned(columns, rows) -> list[str]:
    """A header line and a line a row: each cell right-aligned to its column's width in its
    column's format, the columns one space apart (``columns``: (title, width, format spec);
    ``rows``: the cells of each row, in the columns' order)."""
    lines = [" ".join(f"{title:>{width}}" for title, width, _ in columns)]
    return lines + [" ".join(format(cell, f">{width}{spec}") for cell, (_, width, spec) in zip(row, columns))
                    for row in rows]


def format_flops(flops_report: dict) -> list[str]:
    f = flops_report
    return [f"FLOPs per image by part at {f['width']}x{f['height']} ({f['dtype']}, from shapes; TFLOP):",
            *aligned(FLOPS_COLUMNS, [(row["model"], row["steps"], row["guidance_scale"], str(row["guided"]),
                                      row["text_encoder"] / 1e12, row["denoiser_call"] / 1e12,
                                      row["vae_decode"] / 1e12, row["per_image"] / 1e12) for row in f["rows"]])]


def format_table(report: dict) -> str:
    """The report as a readable table."""
    if "machine" not in report:  # the flops part alone
        return "\n".join(format_flops(report["flops"]))
    c, m, peak = report["config"], report["machine"], report["peak"]["flops_per_s"]
    lines = [f"model {c['model']} {c['width']}x{c['height']} steps {c['steps']} {c['dtype']} on "
             f"{m['devices']} x {m['device_kind']} ({m['platform']}); matmul peak {peak / 1e9:.1f} GFLOP/s"]
    if report["sweep"]:
        lines += aligned(SWEEP_COLUMNS, [(row["per_device_batch"], row["ours"]["images_per_s"],
                                          row["seed"]["images_per_s"], row["ours_over_seed"],
                                          row["flops"]["per_image"] / 1e9, row["achieved_flops_per_s"] / 1e9,
                                          row["utilisation"], row["seed_utilisation"]) for row in report["sweep"]])
    if report.get("models"):
        lines += _models(report["models"])
    if report["recipes"]:
        lines += _recipes(report["recipes"], report["config"]["steps"])
    if report.get("attention"):
        lines += _attention(report["attention"])
    if report.get("memory"):
        lines += _memory(report["memory"])
    if report.get("scoring"):
        lines += _scoring(report["scoring"])
    if report["startup"]:
        lines += _startup(report["startup"])
    if report.get("flops"):
        lines += format_flops(report["flops"])
    if report.get("fsdp"):
        f = report["fsdp"]
        lines.append(f"--fsdp side by side (per-device batch {f['per_device_batch']}, {f['devices']} devices, "
                     f"timed in turns):")
        lines += aligned(FSDP_COLUMNS, [(n, row["images_per_s"], row["over_first"], row["argument_bytes"] / 2 ** 20)
                                        for n, row in f["rows"].items()])
    return "\n".join(lines)


def _models(m: dict) -> list[str]:
    return [f"models side by side (per-device batch {m['per_device_batch']}, {m['steps']} steps, timed in turns):",
            *aligned(MODELS_COLUMNS, [(name, row["guidance_scale"], str(row["guided"]), row["images_per_s"],
                                       row["flops_per_image"] / 1e9, row["over_first"])
                                      for name, row in m["rows"].items()])]


def _recipes(r: dict, steps: int) -> list[str]:
    return [f"recipes (per-device batch {r['per_device_batch']}, timed in turns):",
            *aligned(RECIPES_COLUMNS, [(name, row["scheduler"], str(row["timestep_spacing"]), row["steps"],
                                        row["guidance_scale"], row["batch_size"], row["images_per_s"],
                                        row["flops"]["per_image"] / 1e9) for name, row in r["recipes"].items()]),
            f"guidance-free / CFG at {steps} steps: {r['guidance_free_over_cfg']:.2f}x "
            f"images/s ({r['flops_cfg_over_guidance_free']:.2f}x fewer FLOPs), "
            f"{r['guidance_free_2x_over_cfg']:.2f}x at twice the images per device; few-step guidance-free / "
            f"20-step CFG default: {r['few_step_over_default']:.2f}x ({r['flops_default_over_few_step']:.2f}x)"]


def _attention(a: dict) -> list[str]:
    rows = a["implementations"]
    header, *lines = aligned(ATTENTION_COLUMNS, [(name, row["images_per_s"], row["over_first"],
                                                  row["memory"].get("temp", 0) / GIB,
                                                  row["memory"].get("total", 0) / GIB) for name, row in rows.items()])
    return [f"attention at {a['width']}x{a['height']}, per-device batch {a['per_device_batch']} "
            f"(timed in turns; relative to {a['relative_to']}):", f"{header}  kernels",
            *(f"{line}  {row['kernels']}" for line, row in zip(lines, rows.values()))]


def _memory(mem: dict) -> list[str]:
    return [f"sampler program memory per image (compiled from shapes, per-device batch {mem['per_device_batch']}):",
            *aligned(MEMORY_COLUMNS, [(row["attention"], row["size"], row["temp_per_image"] / GIB,
                                       row["total_per_image"] / GIB) for row in mem["rows"]]),
            *(f"temp {mem['sizes'][-1]}^2 / {mem['sizes'][0]}^2 with {name}: {growth:.2f}x "
              f"(pixels {mem['pixel_growth']:.1f}x)" for name, growth in mem["temp_growth"].items())]


def _scoring(sc: dict) -> list[str]:
    s = sc["scorers"]
    lines = [f"scoring overhead (--score {','.join(s['scores'])}: {s['clip_model']}, {s['aesthetic_head']}, "
             f"{s['safety_checker']}; per-device batch {sc['per_device_batch']}; timed in turns):",
             *aligned(SCORING_COLUMNS, [(name, row["steps"], row["plain"]["images_per_s"],
                                         row["scored"]["images_per_s"], row["overhead"],
                                         row["scorer_flops_over_sampler"]) for name, row in sc["recipes"].items()])]
    f = sc["flops_at_512"]
    if f:
        lines.append(f"at {f['size']}x{f['size']}: scorer {f['scorer_per_image'] / 1e9:.1f} GFLOP/image, "
                     f"{f['cfg_20_steps_scorer_over_sampler']:.2%} of a {f['steps']}-step CFG image, "
                     f"{f['one_step_scorer_over_sampler']:.2%} of a 1-step guidance-free one")
    return lines


def _startup(s: dict) -> list[str]:
    cold, warm = s["cold"], s["warm"]
    lines = [f"start-up of a fresh process (per-device batch {s['per_device_batch']}), seconds:",
             *aligned(STARTUP_COLUMNS, [(label, cold[key], warm[key], f"{warm[key] / cold[key]:.2f}" if cold[key]
                                         else "") for label, key in STARTUP_ROWS]),
             f"sampler from the executable cache: cold {cold['sampler_from_cache']}, warm "
             f"{warm['sampler_from_cache']} ({warm['cache_hits']} cache hits); time to ready warm/cold "
             f"{s['ready_warm_over_cold']:.2f}, fresh process cold/warm {s['cold_over_warm']:.2f}"]
    other = s.get("against")
    if other:
        lines += [f"side by side with {other['root']} (timed in turns), seconds:",
                  *aligned(AGAINST_COLUMNS, [(label, cold[key], other["cold"][key], warm[key], other["warm"][key])
                                             for label, key in STARTUP_ROWS])]
    return lines
