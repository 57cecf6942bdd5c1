"""The sha256 of every image that a fixed set of tiny runs makes: a refactor that must not
change a byte (the model house) is checked by running this before and after it, on the
same machine, and comparing the two JSON files (XLA:CPU's bits may depend on the machine,
so the suite relies on its parity and topology tests instead of stored hashes).

    python tests/image_hashes.py OUT.json [--only NAME ...]

Each run is a real ``promptmill run`` (local engine, CPU devices) into a scratch folder:
SD, SDXL, FLUX.1 [schnell] and [dev], FLUX.2 [klein] (distilled and base) and Z-Image, with
and without a LoRA, --fsdp 2, guided and guidance-free, scored. The JSON holds, per run, every image's key -> sha256, and a digest
of the whole set.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
SCORES = ["--score", "clip,aesthetic,safety", "--clip-model", "tiny-clip", "--aesthetic-head", "tiny-aesthetic",
          "--safety-checker", "tiny-safety-checker"]
SD_LORA = os.path.join(FIXTURES, "loras", "sd", "pytorch_lora_weights.safetensors")
FLUX_LORA = os.path.join(FIXTURES, "flux_loras", "transformer")
KLEIN = os.path.join(FIXTURES, "flux2_pipeline", "model")
KLEIN_LORA = os.path.join(FIXTURES, "flux2_lora", "pytorch_lora_weights.safetensors")
ZIMAGE = os.path.join(FIXTURES, "zimage", "model")
ZIMAGE_LORA = os.path.join(FIXTURES, "zimage_lora", "pytorch_lora_weights.safetensors")

RUNS = {  # name -> the run's own flags
    "sd-guided": ["--model", "tiny", "--guidance-scale", "7.5"],
    "sd-guidance-free": ["--model", "tiny", "--guidance-scale", "0"],
    "sd-scored": ["--model", "tiny", *SCORES],
    "sd-fsdp2": ["--model", "tiny", "--fsdp", "2"],
    "sd-lora": ["--model", os.path.join(FIXTURES, "pt_pipelines", "sd"), "--lora", f"{SD_LORA}@0.8"],
    "sdxl": ["--model", "tiny-sdxl"],
    "flux-schnell": ["--model", "tiny-flux"],
    "flux-schnell-fsdp2": ["--model", "tiny-flux", "--fsdp", "2"],
    "flux-dev": ["--model", "tiny-flux-dev", "--guidance-scale", "3.5"],
    "flux-dev-lora": ["--model", os.path.join(FIXTURES, "flux", "dev"), "--lora", FLUX_LORA],
    "klein": ["--model", "tiny-klein"],
    "klein-fsdp2": ["--model", "tiny-klein", "--fsdp", "2"],
    "klein-base": ["--model", "tiny-klein-base", "--guidance-scale", "4.0"],
    "klein-base-guidance-free": ["--model", "tiny-klein-base", "--guidance-scale", "1.0"],
    "klein-lora": ["--model", KLEIN, "--width", "32", "--height", "32", "--lora", f"{KLEIN_LORA}@0.5"],
    "zimage": ["--model", "tiny-zimage"],
    "zimage-guided": ["--model", "tiny-zimage", "--guidance-scale", "4.0"],
    "zimage-fsdp2": ["--model", "tiny-zimage", "--guidance-scale", "4.0", "--fsdp", "2"],
    "zimage-lora": ["--model", ZIMAGE, "--width", "32", "--height", "32", "--lora", f"{ZIMAGE_LORA}@0.5"],
}
PROMPTS = [{"prompt": "a red cube on a table"}, {"prompt": "a blue sphere", "num_images": 2},
           {"prompt": "a green cone", "guidance_scale": 1.0}, {"prompt": "a yellow torus", "seed": 7}]


def run(name: str, flags: list[str], scratch: str) -> dict:
    prompts = os.path.join(scratch, "prompts.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in PROMPTS)
    out = os.path.join(scratch, name)
    args = [sys.executable, "-m", "jobs.cli", "run", "--prompts", prompts, "--out", out, "--hosts", "1",
            "--devices-per-host", "2", "--steps", "2", "--per-device-batch", "1", "--batches-per-slice", "2",
            "--no-progress", "--no-compile-cache", *flags]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    hashes = {}
    for folder, _, files in os.walk(os.path.join(out, "images")):
        for file in files:
            if not file.endswith((".png", ".jpg", ".webp")):  # a slice folder's metadata.jsonl (collect's)
                continue
            with open(os.path.join(folder, file), "rb") as f:
                hashes[os.path.splitext(file)[0]] = hashlib.sha256(f.read()).hexdigest()
    digest = hashlib.sha256(json.dumps(sorted(hashes.items())).encode()).hexdigest()
    return {"images": dict(sorted(hashes.items())), "digest": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS))
    args = parser.parse_args()
    found = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.only or RUNS:
            found[name] = run(name, RUNS[name], scratch)
            print(f"{name}: {len(found[name]['images'])} images, {found[name]['digest'][:16]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(found, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
