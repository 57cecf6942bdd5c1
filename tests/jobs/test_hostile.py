"""The second hostile battery: each case an attacker or a careless hand tried against a
run (a stray quote, two launchers, links out of OUT, code beside the user, names from a
bucket), refused clearly or made harmless, nothing lost and nothing of the user's touched.
The end-to-end cases that need a whole run ride on runs other modules make anyway
(tests/core/test_buckets.py: an OUT with glob characters, --overwrite beside links)."""
import json
import os

import pytest

from jobs import cli
from pipeline.core import naming
from pipeline.io import listing, storage
from pipeline.plan import inputs
from tests import trees


def _rows(path):
    return [(number, payload if isinstance(payload, dict) else (payload.reason, payload.message))
            for _, number, payload in inputs.read_rows(str(path))]


STRAY_QUOTES = [  # (file, rows read: (line, record or (reason, message)))
    ('id,prompt\nr0,a cat\nr1,"4k photo of a dog\nr2,a bird\nr3,a fish\n',
     [(2, {"id": "r0", "prompt": "a cat"}), (3, ("bad_row", "a quoted field is still open at the end of the file")),
      (4, {"id": "r2", "prompt": "a bird"}), (5, {"id": "r3", "prompt": "a fish"})]),
    ('id,prompt\nr1,"4k\nr2,a bird\nr3,"a fish"\n',  # the stray quote closes at a later one: text follows it
     [(2, ("bad_row", "text follows a closing quote")), (3, {"id": "r2", "prompt": "a bird"}),
      (4, {"id": "r3", "prompt": "a fish"})]),
    ('id,prompt\nr1,"a, ""quoted"" word\nacross lines"\nr2,x\n',  # a real multi-line field stays one
     [(2, {"id": "r1", "prompt": 'a, "quoted" word\nacross lines'}), (4, {"id": "r2", "prompt": "x"})]),
    ('id,prompt\nr1,"a\nr2",b,c\nr3,d\n',  # a multi-line row of another field count gives its lines back
     [(2, ("bad_row", "the row has 4 fields, the header has 2")), (3, ("bad_row", "the row has 3 fields")),
      (4, {"id": "r3", "prompt": "d"})]),
    ('id\tprompt\nr1\t"x\nr2\ty\n', [(2, ("bad_row", "still open")), (3, {"id": "r2", "prompt": "y"})]),
]


@pytest.mark.parametrize("text,expected", STRAY_QUOTES, ids=range(len(STRAY_QUOTES)))
def test_a_stray_quote_rejects_its_row_and_never_swallows_the_rest(tmp_path, text, expected):
    path = tmp_path / ("p.tsv" if "\t" in text else "p.csv")
    path.write_text(text)
    found = _rows(path)
    assert [line for line, _ in found] == [line for line, _ in expected]
    for (_, got), (_, want) in zip(found, expected):
        if isinstance(want, dict):
            assert got == want
        else:
            assert got[0] == want[0] and want[1] in got[1], got


QUOTE = '"'


def test_a_stray_quote_in_a_thousand_rows_loses_none_through_the_cli(tmp_path, model_cache, capfd):
    """The battery's case: 1,000 rows, a stray quote in row 3: one reject, 999 records."""
    rows = [f"r{n},{QUOTE if n == 3 else ''}prompt number {n}" for n in range(1000)]
    (tmp_path / "p.csv").write_text("id,prompt\n" + "\n".join(rows) + "\n")
    assert cli.main(["plan", "--prompts", str(tmp_path / "p.csv"), "--out", str(tmp_path / "out"), "--steps", "2",
                     "--model", "tiny"]) == 0
    summary = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert (summary["input_rows"], summary["records"], summary["rejects"]) == (1000, 999, 1)
    [reject] = [json.loads(line) for path in storage.files(naming.rejects_dir(str(tmp_path / "out")))
                for line in storage.read_text(path).splitlines()]
    assert (reject["line"], reject["reason"]) == (5, "bad_row") and "still open" in reject["message"]


def test_a_prompt_folder_of_link_loops_lists_each_file_once_and_ends(tmp_path):
    folder = tmp_path / "prompts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"prompt": "a"}\n')
    (folder / "sub" / "b.jsonl").write_text('{"prompt": "b"}\n')
    os.symlink(".", folder / "self")
    os.symlink("..", folder / "sub" / "up")
    os.symlink("sub", folder / "also-sub")  # the same folder twice: its file is planned once
    os.symlink("missing", folder / "dangling.jsonl")
    (folder / ".promptmill-tmp-x.jsonl").write_text("a file being written")
    expected = [str(folder / "a.jsonl"), str(folder / "also-sub" / "b.jsonl")]
    assert storage.glob(str(folder)) == expected
    assert storage.glob(str(folder / "**" / "*.jsonl")) == expected
    assert storage.glob(str(folder / "*.jsonl")) == [str(folder / "a.jsonl")]


def test_a_fifo_as_prompts_is_named_for_what_it_is(tmp_path, capfd):
    os.mkfifo(tmp_path / "p.jsonl")
    assert cli.main(["plan", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "out")]) == 1
    assert "is a FIFO (named pipe), not a prompt file or a folder of them" in capfd.readouterr().err
    with pytest.raises(listing.NotAPromptFile, match="character device"):
        storage.glob("/dev/null")


@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_folder_of_a_users_files_without_a_run_is_refused_by_every_command_that_writes(tmp_path, model_cache,
                                                                                          capfd, command):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n')
    out = tmp_path / "mine"
    for name in ("dataset/index.html", "dataset/stats.json", "images/metadata.jsonl", "thesis.tex"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(f"the user's {name}")
    before = trees.checksums(str(out))
    assert cli.main([command, "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out), "--steps", "2"]) == 1
    err = capfd.readouterr().err
    assert f"{out} holds files that no promptmill run wrote (thesis.tex) and no run.json" in err
    assert "give a new --out" in err
    assert trees.checksums(str(out)) == before


def test_a_crashed_runs_lease_lapses_and_a_live_one_holds(tmp_path, monkeypatch):
    """A lease whose processes on this machine are all gone is over at once; one held
    from elsewhere (a submitted job's hosts) stands until it expires; a holder whose lease
    another owner took finds it lost; the same job's submit takes its own lease up again."""
    import subprocess
    import sys
    import time

    from pipeline.io import lease

    out = str(tmp_path / "out")
    subprocess.run([sys.executable, "-c", f"from pipeline.io import lease; lease.acquire({out!r}, 'a crashed run')"],
                   check=True)
    crashed, _ = lease.read(out)
    assert crashed.pids and not crashed.live(time.time())
    mine = lease.acquire(out, "promptmill run")  # taken over
    with pytest.raises(lease.LeaseHeld, match="is in use by promptmill run"):
        lease.acquire(out, "promptmill plan")
    with pytest.raises(lease.LeaseLost, match="no longer holds the lease"):
        lease.renew(out, crashed.owner)
    lease.release(out, mine.owner)
    job = lease.acquire(out, "promptmill submit gke j", owner="gke:default/j")
    held, _ = lease.read(out)
    assert held.remote and held.live(time.time()) and not held.live(held.expires + 1)
    assert lease.acquire(out, "promptmill submit gke j", owner="gke:default/j").owner == job.owner  # followed again
    with pytest.raises(lease.LeaseHeld):
        lease.acquire(out, "promptmill submit gke k", owner="gke:default/k")
    monkeypatch.setenv(lease.OWNER_ENV, "gke:default/j")
    renewer = lease.host_renewer(out)
    renewer.stop()
    assert os.getpid() in [pid for pid, _ in lease.read(out)[0].pids]


def test_a_plug_in_familys_code_is_in_the_compile_caches_key(tmp_path):
    """A family registered from outside the package builds programs too: an edit to its
    code (here, to a helper module of its own package) is a new compile-cache key, where
    the next run would otherwise load the program compiled from the old code."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import ROOT

    package = tmp_path / "myfamily"
    package.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "scratch_family.py"), package / "family.py")
    (package / "__init__.py").write_text("")
    (package / "helper.py").write_text("SCALE = 1.0\n")
    with open(package / "family.py", "a") as f:
        f.write("\nfrom myfamily import helper  # noqa: E402,F401\n")

    def digest():
        env = dict(os.environ, PROMPTMILL_FAMILIES="myfamily.family:SCRATCH",
                   PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
        return subprocess.run([sys.executable, "-c", "from pipeline.generate import compile_cache; "
                               "print(compile_cache.code_digest())"], env=env, cwd=str(tmp_path), check=True,
                              capture_output=True, text=True).stdout.strip()

    first = digest()
    assert digest() == first
    (package / "helper.py").write_text("SCALE = 2.0\n")
    assert digest() != first


def test_child_processes_run_the_installed_package_not_the_users_folder(tmp_path):
    """A user's folder holding ``jobs/cli.py`` and a ``pipeline/`` package of their own: the
    hosts' command and the TPU check's compile children still run promptmill's code."""
    import subprocess

    from pipeline.engines import local
    from pipeline.generate import compile_process

    for name in ("jobs", "pipeline"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise SystemExit('the user folder ran: ' + __name__)\n")
    (tmp_path / "jobs" / "cli.py").write_text("raise SystemExit('the user cli ran')\n")
    host = local.host_command("out", "127.0.0.1:1", 1, 0)
    assert host[host.index("jobs.cli") + 1] == "generate"
    ran = subprocess.run([*host[:host.index("jobs.cli") + 1], "generate", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "--coordinator" in ran.stdout, ran.stderr[-2000:]
    child = subprocess.run([*compile_process.COMMAND, "missing-request", "missing-answer"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert "the user" not in child.stdout + child.stderr
    assert "No such file or directory: 'missing-request'" in child.stderr, child.stderr[-2000:]


@pytest.mark.parametrize("name,safe", [("unet/config.json", True), ("a/b/c.safetensors", True), ("/home/u/.bashrc", False),
                                       ("../../x", False), ("unet/../../x", False), ("a//b", False), ("./a", False),
                                       ("a/", False), ("a\\b", False), ("a\nb", False), ("a\x7fb", False), ("", False)])
def test_a_checkpoints_object_names_must_stay_inside_the_cache(name, safe):
    from pipeline.model.loading import fetch

    assert fetch.safe_name(name) == safe


def test_a_gs_checkpoint_with_names_leading_out_is_refused_and_writes_nothing(model_cache, tmp_path, monkeypatch):
    """GCS takes any object name, ``model//home/u/.bashrc`` and ``model/../../x`` among them;
    the emulator does not, so its listing is given here as GCS would give it."""
    from pipeline.io import storage as storage_lib
    from pipeline.model import load as model_lib
    from pipeline.model.loading import fetch

    entry = {"size": 5, "md5": "x", "crc32c": "y"}
    listing = {"model_index.json": entry, f"/{tmp_path}/planted": entry, "unet/../../../planted": entry}
    monkeypatch.setattr(storage_lib, "object_checksums", lambda prefix: listing)
    monkeypatch.setattr(storage_lib, "download_verified", lambda *a, **k: pytest.fail("nothing may be downloaded"))
    with pytest.raises(model_lib.ModelError, match=r"cannot be files of a checkpoint .*planted.*nothing was copied"):
        fetch.fetch_remote("gs://bucket/models/evil")
    assert not (tmp_path / "planted").exists()


def test_each_sizes_chosen_batch_travels_to_the_plan_a_submission_launches():
    """``submit --sizes ... --per-device-batch auto``: the TPU check chooses a batch per size;
    the plan command carries each (``--per-device-batch N,N``) and reads them back."""
    from jobs import flags
    from pipeline.cloud import gke
    from pipeline.core.settings import Settings

    checked = Settings(prompts="gs://b/p.jsonl", out="gs://b/o", sizes=("64x64", "32x32"), per_device_batch=4,
                       bucket_batches=(4, 16), devices_per_host=8)
    command = gke.settings_flags(checked)
    assert ("--per-device-batch", "4,16") in zip(command, command[1:])
    assert flags.settings_from_flags(command) == checked


def test_a_resumed_submission_checks_the_decode_program_its_plan_chose(tmp_path, model_cache):
    from pipeline.cloud import program_check, tpu
    from pipeline.core.settings import Settings
    from pipeline.plan import transforms as plan

    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    planned = Settings(prompts=str(tmp_path / "p.jsonl"), out=str(tmp_path / "out"), steps=2, decode_batch=1)
    plan.run_plan(planned)
    asked = planned.replace(decode_batch="auto")
    settings, _, _ = program_check.resolve_submission(asked, tpu.lookup("v5e", "2x2"), skip=True)
    assert settings.decode_batch == 1


def test_a_compile_cache_the_hosts_would_refuse_is_refused_before_planning(tmp_path, model_cache, capfd):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n')
    cache = tmp_path / "cc"
    cache.mkdir()
    os.mkfifo(cache / "planted")
    out = tmp_path / "out"
    assert cli.main(["run", "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out), "--compile-cache", str(cache),
                     "--steps", "2"]) == 1
    assert "refusing the compile cache folder" in capfd.readouterr().err
    assert not out.exists()  # nothing was planned


def test_captions_are_padded_on_the_right_whatever_the_tokenizer_config_says(tmp_path):
    """Z-Image (and FLUX.2) read a caption's tokens from the start of its row: a checkpoint
    whose tokenizer config pads on the left still gets its padding on the right."""
    import shutil

    from pipeline.model.families.zimage import sampling
    from pipeline.model.loading import qwen_tokenizer

    qwen_tokenizer.write(str(tmp_path / "right"))
    shutil.copytree(tmp_path / "right", tmp_path / "left")
    config = json.loads((tmp_path / "left" / "tokenizer_config.json").read_text())
    assert config["padding_side"] == "right"
    config.update(padding_side="left", truncation_side="left")
    (tmp_path / "left" / "tokenizer_config.json").write_text(json.dumps(config))
    captions = ["a cat", "a much longer caption of a dog"]
    right = sampling.tokenize(qwen_tokenizer.load(str(tmp_path / "right")), captions, 64)
    ids, mask = sampling.tokenize(qwen_tokenizer.load(str(tmp_path / "left")), captions, 64)
    assert (ids == right[0]).all() and (mask == right[1]).all()
    assert all(row[:row.sum()].all() and not row[row.sum():].any() for row in mask)


def test_parquet_times_binary_prompts_and_nan_are_read_as_text_reject_and_absent(tmp_path):
    """Nanosecond times (which pyarrow turns into Python only through pandas) are ISO text; a
    binary prompt that is not UTF-8 is a reject, never its base64 as the prompt; NaN, a
    missing number as pandas writes it, is an absent field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([b"a cat", b"\xff\xfe", b"a dog"], pa.binary()),
                             "when": pa.array([0, 1, 2], pa.timestamp("ns")), "score": [1.5, 2.0, float("nan")]}),
                   tmp_path / "p.parquet")
    found = _rows(tmp_path / "p.parquet")
    assert found[0] == (1, {"prompt": "a cat", "when": "1970-01-01 00:00:00.000000000", "score": 1.5})
    assert found[1] == (2, ("invalid_utf8", "the 'prompt' column holds bytes that are not UTF-8 text"))
    assert found[2] == (3, {"prompt": "a dog", "when": "1970-01-01 00:00:00.000000002"})


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "32x32,,64x64"], "has an empty size between its commas"),
    (["--per-device-batch", "1,x"], "one per size (N,N,...)"),
])
def test_flags_with_holes_are_refused(tmp_path, capfd, argv, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--prompts", "p.jsonl", "--out", str(tmp_path / "o"), *argv])
    assert exited.value.code == 2 and message in capfd.readouterr().err


@pytest.mark.parametrize("prompts,out", [("{p}/**/*.jsonl", "{p}/out"), ("{p}", "{p}/sub/out"),
                                         ("{p}/*/*/*.parquet", "{p}/out")])
def test_an_out_inside_the_prompt_folder_is_refused_when_planning(tmp_path, model_cache, capfd, prompts, out):
    folder = tmp_path / "prompts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"prompt": "a"}\n')
    (folder / "sub" / "b.jsonl").write_text('{"prompt": "b"}\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "sub" / "deeper").mkdir()
    pq.write_table(pa.table({"prompt": ["c"]}), folder / "sub" / "deeper" / "c.parquet")
    code = cli.main(["plan", "--prompts", prompts.format(p=folder), "--out", out.format(p=folder), "--steps", "2"])
    assert code == 1 and "is inside the prompt folder" in capfd.readouterr().err
    assert not os.path.exists(out.format(p=folder))


def test_a_plug_in_family_that_cannot_be_imported_is_one_line_for_every_command(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = dict(os.environ, PROMPTMILL_FAMILIES="no_such_family_module:FAMILY")
    for argv in (["--help"], ["status", "x"]):
        ran = subprocess.run([sys.executable, "-m", "jobs.cli", *argv], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
        assert ran.returncode == 2 and ran.stderr.strip().splitlines() == [
            "promptmill: error: PROMPTMILL_FAMILIES: cannot import the family 'no_such_family_module:FAMILY': "
            "No module named 'no_such_family_module'"], ran.stderr


def test_a_truncated_gzip_input_is_said_once_without_beams_traceback(tmp_path, model_cache):
    import gzip

    from tests.conftest import run_cli

    whole = gzip.compress(b"".join(b'{"prompt": "p%d"}\n' % n for n in range(200)))
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    result = run_cli(["plan", "--prompts", str(tmp_path / "cut.jsonl.gz"), "--out", str(tmp_path / "out")], model_cache)
    said = [line for line in result.stderr.splitlines() if not line.startswith('{"ts"')]
    assert result.returncode == 1 and said == [line for line in said if line.startswith("promptmill plan: error: ")]
    assert len(said) == 1 and "ends early" in said[0] and "Traceback" not in result.stderr
