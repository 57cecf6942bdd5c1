"""The persistent compilation cache: where it lives and how it reaches the hosts.

That a gs:// cache filled by one run's host is used by the next run's, on a fresh
machine, is shown end to end by the two triggers of one date in tests/test_schedule.py.
"""
import dataclasses
import os

import pytest

from pipeline.engines import local as launcher
from pipeline.generate import compile_cache


def test_local_folders_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert compile_cache.resolve("cc") == str(tmp_path / "cc")
    assert compile_cache.resolve(str(tmp_path / "x")) == str(tmp_path / "x")


def test_unusable_folders_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="local folder or gs://"):
        compile_cache.resolve("s3://bucket/cache")
    with pytest.raises(ValueError, match="needs a folder"):
        compile_cache.resolve("")
    assert compile_cache.resolve("gs://bucket/cache/") == "gs://bucket/cache"


def test_host_command_forwards_the_cache_as_an_absolute_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = launcher.host_command("out", "127.0.0.1:1", 2, 1, compile_cache="cc")
    assert command[command.index("--compile-cache") + 1] == str(tmp_path / "cc")
    assert "--compile-cache" not in launcher.host_command("out", "127.0.0.1:1", 2, 1)


def _sin_program(devices):
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = np.arange(len(devices) * 3, dtype=np.float32).reshape(len(devices), 3)
    return jax.pmap(lambda v: jnp.sin(v) * 3 + 1, devices=devices).lower(x), x


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_an_executable_compiled_once_is_loaded_after_and_computes_the_same(where, tmp_path, request):
    import jax
    import numpy as np

    folder = str(tmp_path / "executables")
    if where == "gcs":
        folder = f"gs://{request.getfixturevalue('gcs_emulator')}/{tmp_path.name}/executables"
    devices = jax.local_devices()
    lowered, x = _sin_program(devices)
    compiled, hit = compile_cache.load_or_compile(lowered, devices, folder)
    assert not hit
    loaded, hit = compile_cache.load_or_compile(_sin_program(devices)[0], devices, folder)
    assert hit
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(compiled(x)))
    # another device assignment is another key: one device alone compiles its own
    assert compile_cache.executable_key(lowered, devices) != \
        compile_cache.executable_key(_sin_program(devices[:1])[0], devices[:1])


def test_an_unreadable_entry_is_compiled_again_and_replaced(tmp_path):
    import jax

    devices = jax.local_devices()
    lowered, x = _sin_program(devices)
    folder = str(tmp_path)
    (tmp_path / compile_cache.executable_key(lowered, devices)).write_bytes(b"not an executable")
    _, hit = compile_cache.load_or_compile(lowered, devices, folder)
    assert not hit
    assert compile_cache.load_or_compile(lowered, devices, folder)[1]


def test_the_index_finds_a_sampler_without_tracing_it_and_it_makes_the_same_images(tmp_path, model_cache,
                                                                                    monkeypatch):
    import jax
    import numpy as np

    from pipeline.core.settings import Settings
    from pipeline.generate import generator, runtime
    from pipeline.model import load

    monkeypatch.setattr(compile_cache, "_executables", str(tmp_path / "executables"))
    traced = []
    lower = generator.lower_sampler
    monkeypatch.setattr(generator, "lower_sampler", lambda *a, **k: traced.append(1) or lower(*a, **k))
    settings = Settings(model="tiny", width=32, height=32, steps=1, per_device_batch=1, guided=True)
    devices = jax.local_devices()[:1]
    cold = runtime.compile_run_sampler(settings, devices)
    assert cold.lowered and not cold.from_cache and traced == [1]
    warm = runtime.compile_run_sampler(settings, devices)
    assert not warm.lowered and warm.from_cache and warm.compiles == 0 and traced == [1]
    model = load.load("tiny")
    images = [runtime.make_generator(model, settings, devices, program) for program in (cold, warm)]
    assert all(g.program_given for g in images)
    batch = images[0].batch_of([("a red cube", "", 7.5, 3, 0)])
    np.testing.assert_array_equal(images[0](batch), images[1](batch))
    # other settings, another program: the index knows none for them
    key = compile_cache.index_key(runtime.sampler_description(dataclasses.replace(settings, steps=2)), devices)
    assert key != compile_cache.index_key(runtime.sampler_description(settings), devices)
    assert compile_cache.load_indexed(key, devices) is None


def test_the_index_key_follows_jax_configuration_but_not_the_caches_folder(tmp_path):
    import jax

    devices = jax.local_devices()
    key = compile_cache.index_key({"model": "m"}, devices)
    assert compile_cache.index_key({"model": "m"}, devices) == key
    assert compile_cache.index_key({"model": "n"}, devices) != key
    before = jax.config.values["jax_default_matmul_precision"]
    try:  # tracing reads it: another precision is another program
        jax.config.update("jax_default_matmul_precision", "highest")
        assert compile_cache.index_key({"model": "m"}, devices) != key
    finally:
        jax.config.update("jax_default_matmul_precision", before)
    assert compile_cache.index_key({"model": "m"}, devices[:1]) != key  # other devices
    folder = jax.config.values["jax_compilation_cache_dir"]
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        assert compile_cache.index_key({"model": "m"}, devices) == key
    finally:
        jax.config.update("jax_compilation_cache_dir", folder)


def test_a_checkpoints_program_digest_is_its_configs_not_its_weights(tmp_path, model_cache):
    import json
    import shutil

    from pipeline.model import load, sources

    tiny = load.resolve("tiny")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    shutil.copytree(tiny, a)
    shutil.copytree(tiny, b)
    with open(os.path.join(b, "vae", "diffusion_flax_model.msgpack"), "r+b") as f:  # other weights
        f.seek(100)
        f.write(b"\x01\x02\x03")
    assert sources.program_digest(a) == sources.program_digest(b) == sources.program_digest("tiny")
    config = json.loads(open(os.path.join(b, "unet", "config.json")).read())
    config["attention_head_dim"] = 4
    with open(os.path.join(b, "unet", "config.json"), "w") as f:
        json.dump(config, f)
    assert sources.program_digest(b) != sources.program_digest(a)


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory, model_cache):
    """The same 2-host x 1-device run twice, into two OUTs, with one compile cache."""
    from tests.conftest import run_cli

    folder = tmp_path_factory.mktemp("warm")
    (folder / "prompts.jsonl").write_text("".join(f'{{"prompt": "a small thing {n}"}}\n' for n in range(4)))
    cache = str(folder / "compile-cache")
    outs = []
    for name in ("cold", "warm"):
        out = str(folder / name)
        result = run_cli(["run", "--prompts", str(folder / "prompts.jsonl"), "--out", out, "--model", "tiny",
                          "--hosts", "2", "--devices-per-host", "1", "--width", "32", "--height", "32",
                          "--steps", "1", "--per-device-batch", "1", "--batches-per-slice", "1", "--no-progress",
                          "--compile-cache", cache], model_cache)
        assert result.returncode == 0, result.stderr[-3000:]
        outs.append(out)
    return outs


def _ready(out: str) -> dict[int, dict]:
    """{host: its host_ready event} of a run's host logs."""
    from pipeline.core import logs, naming
    from pipeline.io import storage

    events = [e for path in storage.glob(naming.join(out, "logs", "host-*.log"))
              for e in map(logs.parse, storage.read_text(path).splitlines()) if e and e["event"] == "host_ready"]
    return {e["host"]: e for e in events}


def test_on_a_rerun_every_host_loads_its_sampler_and_none_compiles_it(cold_and_warm):
    cold, warm = map(_ready, cold_and_warm)
    assert sorted(cold) == sorted(warm) == [0, 1]
    for host in (0, 1):
        # cold: every host compiled its own sampler (its devices are its own) and wrote it
        assert cold[host]["sampler_compiles"] >= 1 and not cold[host]["sampler_from_cache"]
        assert cold[host]["cache_writes"] >= 1
        # warm: every host loaded it, and nothing it compiled was the sampler
        assert warm[host]["sampler_from_cache"] and warm[host]["cache_hits"] >= 1
        # found through the index: not even traced
        assert cold[host]["sampler_lowered"] and not warm[host]["sampler_lowered"]
        assert warm[host]["sampler_compiles"] == 0 and warm[host]["cache_writes"] == 0
        assert warm[host]["compiles"] < cold[host]["compiles"]
        # the sampler was compiled (or loaded) from shapes while the weights loaded
        for event in (cold[host], warm[host]):
            assert all(event[f"{part}_s"] >= 0 for part in ("load", "compile", "wait", "transfer"))
            # the time to ready holds every part but the compile (it overlapped the load)
            assert event["ready_s"] >= sum(event[f"{part}_s"] for part in ("load", "wait", "transfer"))
    # time to ready (not asserted: the machine is shared); the test's output shows it
    for name, events in (("cold", cold), ("warm", warm)):
        print(name, {h: {k: e[k] for k in ("ready_s", "load_s", "compile_s", "wait_s", "transfer_s")}
                     for h, e in events.items()})


def test_a_loaded_sampler_writes_the_same_bytes(cold_and_warm):
    from pipeline.io import storage

    cold, warm = cold_and_warm
    images = {out: {path[len(out):]: storage.read_bytes(path) for path in storage.glob(f"{out}/images/**/*.png")}
              for out in cold_and_warm}
    assert len(images[cold]) == 4 and images[cold] == images[warm]


def test_a_local_run_is_warm_by_default_unless_told_not(tmp_path, monkeypatch, capsys):
    from jobs import cli

    monkeypatch.setenv("PROMPTMILL_CACHE", str(tmp_path / "pm"))
    caches = []

    def run_local(settings, hosts, beam_args, progress, compile_cache, overwrite):
        caches.append(compile_cache)
        return dict.fromkeys(cli.SUMMARY, 0)

    monkeypatch.setattr(launcher, "run_local", run_local)
    base = ["run", "--prompts", "p.jsonl", "--out", str(tmp_path / "out")]
    assert cli.main(base) == 0
    assert cli.main([*base, "--compile-cache", str(tmp_path / "mine")]) == 0
    assert cli.main([*base, "--no-compile-cache"]) == 0
    assert caches == [str(tmp_path / "pm" / "compile-cache" / "local"), str(tmp_path / "mine"), None]
    assert cli.main([*base, "--no-compile-cache", "--compile-cache", "x"]) == 1
    assert "not both" in capsys.readouterr().err


def test_the_host_check_reads_no_checkpoint_byte_when_the_plans_table_matches(tmp_path, monkeypatch, model_cache):
    """The plan hashes the checkpoint once and writes its file table; a host on a machine
    that hashed it since it last changed reads none of its bytes. A changed file is
    refused, named, whatever its size."""
    import builtins
    import shutil

    from pipeline.model import sources

    directory = str(tmp_path / "model")
    shutil.copytree(sources.resolve("tiny"), directory)
    planned = sources.fingerprint(directory)
    table = sources.file_table(directory)
    assert planned == sources.fingerprint(directory) and len(table) > 5

    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file).startswith(directory):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    sources.check_files(directory, table)
    assert opened == []

    weights = os.path.join(directory, "unet", "diffusion_flax_model.msgpack")
    data = bytearray(open(weights, "rb").read())
    data[-1] ^= 1  # same size, other bytes
    with real_open(weights, "wb") as f:
        f.write(data)
    with pytest.raises(sources.ModelError, match="unet/diffusion_flax_model.msgpack differs"):
        sources.check_files(directory, table)
    with real_open(weights, "ab") as f:
        f.write(b"x")
    with pytest.raises(sources.ModelError, match="unet/diffusion_flax_model.msgpack has"):
        sources.check_files(directory, table)
