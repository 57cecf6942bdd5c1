"""The same run on 2 hosts of 2 devices and on 1 host of 4 makes the same bytes, for the
families and recipes that the other topology tests leave out: SDXL (guided, one record
unguided at guidance 1), FLUX.1 [schnell] replicated (``--fsdp 1``, the per-device program), FLUX.2
[klein] distilled and Z-Image-Turbo (both guidance-free). SD guided and guidance-free are
in test_e2e.py, FLUX.1 [dev] at ``--fsdp 2`` in test_flux.py, klein base guided in
test_flux2_pipeline.py, Z-Image guided in test_zimage.py.

Each run is a real ``promptmill run`` (local engine, host processes of CPU devices) at
32x32 and 2 steps: an image's bits may depend on nothing but its record."""
import json

import pytest

from pipeline.collect import parts
from pipeline.core import naming
from pipeline.io import storage
from tests.conftest import run_cli

ROWS = [{"prompt": "a red fox", "id": "fox", "seed": 3},
        {"prompt": "a blue whale", "id": "whale", "seed": 3, "num_images": 2},
        {"prompt": "a full moon", "id": "moon"}]

CASES = {  # name -> (model, its flags, the moon's own guidance scale, guided)
    # at 1 an SDXL image is unguided in the guided program's batch
    "sdxl-guided": ("tiny-sdxl", [], 1.0, True),
    "flux-schnell-fsdp1": ("tiny-flux", ["--fsdp", "1", "--max-sequence-length", "16"], 0.0, False),
    "klein-distilled": ("tiny-klein", ["--max-sequence-length", "48"], 0.0, False),
    # (Z-Image's scale 1 guides: the whole run would take the guided program)
    "zimage-turbo": ("tiny-zimage", ["--guidance-scale", "0", "--max-sequence-length", "64"], 0.0, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_is_the_same_on_1x4_and_2x2(case, tmp_path, model_cache):
    model, flags, moon_guidance, guided = CASES[case]
    prompts = tmp_path / "p.jsonl"
    rows = [*ROWS[:2], {**ROWS[2], "guidance_scale": moon_guidance}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hashes = []
    for hosts, devices in ((2, 2), (1, 4)):
        out = str(tmp_path / f"{hosts}x{devices}")
        result = run_cli(["run", "--prompts", str(prompts), "--out", out, "--model", model, "--width", "32",
                          "--height", "32", "--hosts", str(hosts), "--devices-per-host", str(devices), "--steps", "2",
                          "--per-device-batch", "1", "--batches-per-slice", "1", *flags, "--no-progress"], model_cache)
        assert result.returncode == 0, result.stderr[-4000:]
        assert json.loads(result.stdout.strip().splitlines()[-1]) == {"images": 4, "records": 3, "rejects": 0,
                                                                      "verified": True}
        settings = storage.read_json(naming.run_json(out))["settings"]
        assert (settings["guided"], settings["devices_per_host"]) == (guided, devices)
        hashes.append({row["key"]: row["sha256"] for row in parts.dataset_rows(out)})
    assert len(hashes[0]) == 4 and hashes[0] == hashes[1]
    assert hashes[0]["fox_0000"] != hashes[0]["whale_0000"] != hashes[0]["whale_0001"]  # one seed, other images
