"""Re-planning an OUT: the same settings resume, other settings are refused unless
``--overwrite``, which deletes exactly what promptmill wrote there."""
import pytest

from pipeline.core import naming
from pipeline.core.settings import Settings
from pipeline.io import storage
from pipeline.plan import transforms as plan


@pytest.fixture
def planned(tmp_path, model_cache):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    settings = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "out"), steps=3)
    plan.run_plan(settings)
    return settings


def test_resuming_keeps_the_first_run_json(planned):
    first = storage.read_json(naming.run_json(planned.out))
    storage.write_json(naming.run_json(planned.out), dict(first, created_at="2000-01-01T00:00:00+00:00"))
    plan.run_plan(planned)
    assert storage.read_json(naming.run_json(planned.out))["created_at"] == "2000-01-01T00:00:00+00:00"


def test_other_settings_are_refused_with_a_hint_and_nothing_changes(planned):
    before = storage.checksums(planned.out)
    with pytest.raises(plan.PlanError, match=r"changed: steps, width\).*--overwrite"):
        plan.run_plan(planned.replace(steps=4, width=64))
    assert storage.checksums(planned.out) == before


def test_overwrite_deletes_only_what_promptmill_wrote(planned):
    out = planned.out
    for name in ("shards/00007.tar", "images/00007/old.png", "thumbs/00007/old.jpg", "logs/host-0.log",
                 "dataset/stats.json"):
        storage.write_bytes(naming.join(out, name), b"from the old run")
    storage.write_bytes(naming.join(out, "notes.txt"), b"the user's own file")
    storage.write_bytes(naming.join(out, "planning", "keep.txt"), b"a folder whose name starts like 'plan'")
    manifest = plan.run_plan(planned.replace(steps=4), overwrite=True)
    assert manifest["slices"] == 1
    names = set(storage.checksums(out))
    assert {"notes.txt", "planning/keep.txt", "run.json", "plan/manifest.json", "plan/model_files.json",
            "plan/slices/00000.jsonl"} == names
    assert storage.read_json(naming.run_json(out))["settings"]["steps"] == 4


def test_delete_prefix_on_gcs_takes_the_object_and_its_folder_only(gcs_emulator):
    base = f"gs://{gcs_emulator}/delete-test"
    for name in ("run.json", "run.json.bak", "plan/a", "plan/b/c", "planning/x"):
        storage.write_bytes(f"{base}/{name}", b"x")
    assert storage.delete_prefix(f"{base}/run.json") == 1
    assert storage.delete_prefix(f"{base}/plan") == 2
    assert storage.delete_prefix(f"{base}/nothing") == 0
    assert storage.glob(base) == [f"{base}/planning/x", f"{base}/run.json.bak"]
