"""The persistent compilation cache: where it lives and how it reaches the hosts.

That a gs:// cache filled by one run's host is used by the next run's, on a fresh
machine, is shown end to end by the two triggers of one date in tests/cloud/test_schedule.py.
"""
import dataclasses
import json
import os

import pytest

from pipeline.engines import local as launcher
from pipeline.generate import compile_cache
from pipeline.generate.compile_cache import jax_cache
from pipeline.generate.spec import ProgramSpec


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


def _own_jax_cache(folder, monkeypatch):
    """``compile_cache.enable(folder)``: jax's persistent cache there, keeping every program,
    and the executables under it (the worker's own jax folder comes back before the next
    test, and the executables' folder after this one)."""
    monkeypatch.setattr(jax_cache, "_EXECUTABLES_FOLDER", compile_cache.executables_folder())
    compile_cache.enable(str(folder))


def test_an_executable_that_jaxs_cache_gave_is_not_written_and_a_fresh_compile_is(tmp_path, monkeypatch):
    """XLA:CPU serializes an executable it deserialized without its compiled functions: an
    entry made from one loads, then fails at its first run. So only a program this process
    compiled becomes an entry; one jax's persistent cache gave is used and not written."""
    import jax
    import numpy as np

    from pipeline.core import logs
    from pipeline.generate import jax_events

    _own_jax_cache(tmp_path / "jax", monkeypatch)
    devices = jax.local_devices()
    fresh, x = _sin_program(devices)
    compiled, hit = compile_cache.load_or_compile(fresh, devices, str(tmp_path / "first"))
    assert not hit and os.listdir(tmp_path / "first")  # compiled here: written
    jax.clear_caches()
    hits = jax_events.CACHE.count(jax_events.CACHE_HIT)
    events = []
    monkeypatch.setattr(logs, "event", lambda name, *a, **fields: events.append({"event": name, **fields}))
    served, hit = compile_cache.load_or_compile(_sin_program(devices)[0], devices, str(tmp_path / "second"))
    assert jax_events.CACHE.count(jax_events.CACHE_HIT) == hits + 1 and not hit
    assert not os.path.exists(tmp_path / "second") or not os.listdir(tmp_path / "second")
    assert [e for e in events if e["event"] == "executable_not_cached" and "jax's persistent cache" in e["reason"]]
    np.testing.assert_array_equal(np.asarray(served(x)), np.asarray(compiled(x)))
    # the fresh compile's entry loads and runs
    loaded, hit = compile_cache.load_or_compile(_sin_program(devices)[0], devices, str(tmp_path / "first"))
    assert hit
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(compiled(x)))


class _Payload:
    """A pickle that makes ``path`` (a folder) when unpickled: code run by loading it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


@pytest.fixture
def warnings_logged(caplog):
    """caplog, holding promptmill's events of warning level and above (whether or not
    ``logs.setup`` has stopped them propagating)."""
    import logging

    logger = logging.getLogger("promptmill")
    stopped = not logger.propagate  # else caplog's handler, on the root logger, sees them already
    if stopped:
        logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="promptmill"):
            yield caplog
    finally:
        if stopped:
            logger.removeHandler(caplog.handler)


def _unreadable(caplog) -> list:
    import logging

    return [r for r in caplog.records
            if r.getMessage() == "executable_cache_unreadable" and r.levelno == logging.WARNING]


def _cached_sin(tmp_path):
    """(devices, the sin program lowered, its input, the compiled program, the cache
    folder, the index key): the program compiled into a fresh cache and indexed."""
    import jax

    devices = jax.local_devices()
    lowered, x = _sin_program(devices)
    folder = str(tmp_path / "executables")
    key = compile_cache.index_key({"program": "sin"}, devices)
    compiled, hit = compile_cache.load_or_compile(lowered, devices, folder, index=(key, _extra()))
    assert not hit and compile_cache.load_indexed(key, devices, folder) is not None
    return devices, lowered, x, compiled, folder, key


def _extra():
    import jax
    import jax.numpy as jnp

    return {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32), "b": [jax.ShapeDtypeStruct((4,), jnp.bfloat16), None]}


def test_a_cache_of_pickles_runs_no_code_and_is_compiled_again(tmp_path, warnings_logged):
    import pickle

    import numpy as np

    pickle.loads(pickle.dumps(_Payload(tmp_path / "probe")))  # the payload does run, when unpickled
    assert (tmp_path / "probe").is_dir()
    devices, lowered, x, compiled, folder, key = _cached_sin(tmp_path)
    marker = tmp_path / "ran"
    replaced = 0
    for root, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(root, name), "wb") as f:
                f.write(pickle.dumps(_Payload(marker)))
            replaced += 1
    assert replaced == 2  # the executable and its index entry
    assert compile_cache.load_indexed(key, devices, folder) is None
    assert not marker.exists() and len(_unreadable(warnings_logged)) == 1
    again, hit = compile_cache.load_or_compile(_sin_program(devices)[0], devices, folder, index=(key, _extra()))
    assert not hit and not marker.exists() and len(_unreadable(warnings_logged)) == 2
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(compiled(x)))
    # replaced: found again, through the index too
    assert compile_cache.load_or_compile(_sin_program(devices)[0], devices, folder)[1]
    loaded, extra = compile_cache.load_indexed(key, devices, folder)
    assert extra == _extra()
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(compiled(x)))


def _rewrite(path, edit):
    """Rewrite the entry at ``path`` as (header, bytes) -> (header, bytes) says, with
    digests and length that match its new bytes and description."""
    import hashlib
    import json

    blob = open(path, "rb").read()
    end = blob.index(b"\n", len(compile_cache.ENTRY_MAGIC))
    header, data = edit(json.loads(blob[len(compile_cache.ENTRY_MAGIC):end]), blob[end + 1:])
    header.update(size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                  program_sha256=hashlib.sha256(json.dumps(header["program"], sort_keys=True,
                                                           separators=(",", ":")).encode()).hexdigest())
    with open(path, "wb") as f:
        f.write(compile_cache.ENTRY_MAGIC + json.dumps(header).encode() + b"\n" + data)


def test_a_well_formed_entry_of_pickled_bytes_runs_no_code(tmp_path, warnings_logged):
    import pickle

    devices, lowered, x, compiled, folder, key = _cached_sin(tmp_path)
    marker = tmp_path / "ran"
    path = os.path.join(folder, compile_cache.executable_key(lowered, devices))
    _rewrite(path, lambda header, data: (header, pickle.dumps(_Payload(marker))))
    assert compile_cache.load_indexed(key, devices, folder) is None
    assert compile_cache.load_or_compile(_sin_program(devices)[0], devices, folder)[1] is False
    assert not marker.exists() and len(_unreadable(warnings_logged)) == 2
    assert compile_cache.load_indexed(key, devices, folder) is not None  # replaced


@pytest.mark.parametrize("damage", ["flipped byte", "flipped description", "other key", "other devices",
                                    "other description"])
def test_a_damaged_entry_is_compiled_again_with_a_warning(damage, tmp_path, warnings_logged):
    import numpy as np

    devices, lowered, x, compiled, folder, key = _cached_sin(tmp_path)
    path = os.path.join(folder, compile_cache.executable_key(lowered, devices))
    if damage.startswith("flipped"):
        data = open(path, "rb").read()
        at = len(data) - 100 if damage == "flipped byte" else data.index(b'"shape":[2,3]') + len(b'"shape":[2,')
        data = bytearray(data)
        data[at] ^= 1  # in the executable's bytes; or a 3 turned into a 2 in the description
        open(path, "wb").write(bytes(data))
    elif damage == "other key":
        _rewrite(path, lambda header, data: ({**header, "key": "0" * 64}, data))
    elif damage == "other description":  # consistent, digest and all, but not this program's
        _rewrite(path, lambda header, data: ({**header, "program": {**header["program"], "no_kwargs": True}}, data))
    else:
        _rewrite(path, lambda header, data: ({**header, "devices": header["devices"][::-1]}, data))
    if damage != "other description":  # which the index, without the lowering, cannot tell from its own
        assert compile_cache.load_indexed(key, devices, folder) is None
        assert len(_unreadable(warnings_logged)) == 1
    again, hit = compile_cache.load_or_compile(_sin_program(devices)[0], devices, folder)
    assert not hit and len(_unreadable(warnings_logged)) == (1 if damage == "other description" else 2)
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(compiled(x)))
    assert compile_cache.load_or_compile(_sin_program(devices)[0], devices, folder)[1]  # replaced


@dataclasses.dataclass(frozen=True)
class _State:
    """A pytree class of the tests' own (as a scheduler's state is a flax dataclass)."""
    scale: object
    shift: object


def _register_state():
    import jax

    if not getattr(_State, "_registered", False):
        jax.tree_util.register_dataclass(_State, data_fields=["scale", "shift"], meta_fields=[])
        _State._registered = True


def test_a_program_over_a_mesh_loads_through_the_index_as_it_was_compiled(tmp_path):
    """An FSDP-like program (jit over a (data, fsdp) mesh, a dict and a dataclass in its
    arguments, one argument unused): loaded without its lowering, it has the compiled
    program's types, shardings and trees, and computes the same bits."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    _register_state()
    devices = jax.local_devices()[:2]
    mesh = Mesh(np.array(devices).reshape(1, 2), ("data", "fsdp"))
    rows = NamedSharding(mesh, P(("data", "fsdp"), None))
    split = NamedSharding(mesh, P(None, "fsdp"))

    def fn(params, state, x, unused):
        return {"y": jnp.tanh(x @ params["w"]) * state.scale + state.shift, "n": jnp.sum(x)}

    args = ({"w": jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=split)},
            _State(jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P())),
                   jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))),
            jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=rows), jax.ShapeDtypeStruct((3,), jnp.int32))
    lower = lambda: jax.jit(fn, out_shardings={"y": rows, "n": NamedSharding(mesh, P())}).lower(*args)
    folder = str(tmp_path / "executables")
    key = compile_cache.index_key({"program": "mesh"}, devices)
    extra = {"w": args[0]["w"]}
    compiled, hit = compile_cache.load_or_compile(lower(), devices, folder, index=(key, extra))
    assert not hit
    loaded, kept = compile_cache.load_indexed(key, devices, folder)
    rebuilt, hit = compile_cache.load_or_compile(lower(), devices, folder)
    assert hit and kept == extra
    values = ({"w": jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4) / 16, split)},
              _State(jnp.float32(2), jnp.float32(1)),
              jax.device_put(np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4), rows), np.zeros(3, np.int32))
    for program in (loaded, rebuilt):
        assert program.in_avals == compiled.in_avals and program.in_tree == compiled.in_tree
        assert program.input_shardings == compiled.input_shardings
        assert program.output_shardings == compiled.output_shardings and program.out_tree == compiled.out_tree
        out, fresh = program(*values), compiled(*values)
        for name in ("y", "n"):
            np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(fresh[name]))
            assert out[name].sharding == fresh[name].sharding


def test_local_cache_folders_are_private_and_others_writable_ones_refused(tmp_path):
    import stat

    import jax

    devices = jax.local_devices()
    folder = tmp_path / "cc" / "deeper" / "executables"
    compile_cache.load_or_compile(_sin_program(devices)[0], devices, str(folder),
                                  index=(compile_cache.index_key({"program": "modes"}, devices), _extra()))
    mode = lambda path: stat.S_IMODE(os.stat(path).st_mode)
    for made in (tmp_path / "cc", tmp_path / "cc" / "deeper", folder, folder / compile_cache.INDEX):
        assert mode(made) == 0o700, made
    files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    assert len(files) == 2 and all(mode(f) == 0o600 for f in files)
    compile_cache.remember("k", {"x": 1}, str(tmp_path / "cc"))
    assert mode(tmp_path / "cc" / compile_cache.CHECKS) == 0o700
    assert mode(tmp_path / "cc" / compile_cache.CHECKS / "k.json") == 0o600

    for loose in (0o770, 0o707, 0o722):  # this user's own, made by an earlier version under umask 002: tightened
        os.chmod(folder, loose)
        compile_cache.load_or_compile(_sin_program(devices)[0], devices, str(folder))
        assert mode(folder) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    compile_cache.enable(str(shared))
    assert mode(shared) == 0o700
    os.chmod(tmp_path / "cc" / compile_cache.CHECKS, 0o777)
    compile_cache.recall("k", str(tmp_path / "cc"))
    assert mode(tmp_path / "cc" / compile_cache.CHECKS) == 0o700
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(theirs, 12345, 12345)
    else:  # a folder this user cannot make another's: the root folder is another user's
        theirs = "/"
    with pytest.raises(compile_cache.UnsafeCacheFolder, match=f"{theirs}: it is owned by another user .*chown"):
        compile_cache.enable(str(theirs))
    os.mkfifo(tmp_path / "cc" / "planted")  # a read of it would wait forever
    with pytest.raises(compile_cache.UnsafeCacheFolder, match=r"neither a file nor a folder \(planted\)"):
        compile_cache.enable(str(tmp_path / "cc"))


def test_the_module_unpickles_nothing():
    """No pickle, nor jax's pickling executable serialiser, anywhere in the package."""
    import ast
    import glob

    folder = os.path.dirname(compile_cache.__file__)
    source = "\n".join(open(path).read() for path in sorted(glob.glob(os.path.join(folder, "*.py"))))
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert not {name for name in imported
                if any(bad in name for bad in ("pickle", "serialize_executable", "marshal", "shelve", "dill"))}
    assert "deserialize_and_load" not in source and "pickle." not in source and "loads(" not in \
        source.replace("json.loads(", "")


def test_the_index_finds_a_sampler_without_tracing_it_and_it_makes_the_same_images(tmp_path, model_cache,
                                                                                    monkeypatch):
    import jax
    import numpy as np

    from pipeline.core.settings import Settings
    from pipeline.generate import generator, runtime
    from pipeline.model import load

    # jax's cache and the executables in a folder of the test's own, so the first compile is XLA's, not a
    # program an earlier test left
    _own_jax_cache(tmp_path, monkeypatch)
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
    key = compile_cache.index_key(ProgramSpec.of(dataclasses.replace(settings, steps=2)).description(), devices)
    assert key != compile_cache.index_key(ProgramSpec.of(settings).description(), devices)
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

    from pipeline.model import load as model_load

    tiny = model_load.resolve("tiny")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    shutil.copytree(tiny, a)
    shutil.copytree(tiny, b)
    with open(os.path.join(b, "vae", "diffusion_pytorch_model.safetensors"), "r+b") as f:  # other weights
        f.seek(100)
        f.write(b"\x01\x02\x03")
    assert model_load.program_digest(a) == model_load.program_digest(b) == model_load.program_digest("tiny")
    config = json.loads(open(os.path.join(b, "unet", "config.json")).read())
    config["attention_head_dim"] = 4
    with open(os.path.join(b, "unet", "config.json"), "w") as f:
        json.dump(config, f)
    assert model_load.program_digest(b) != model_load.program_digest(a)


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory, model_cache):
    """The same 2-host x 1-device run twice, into two OUTs, with one compile cache, in two
    sizes (the records ask for the second by aspect ratio): each size's program is cached."""
    from tests.conftest import run_cli

    folder = tmp_path_factory.mktemp("warm")
    rows = [{"prompt": f"a small thing {n}", **({"aspect_ratio": 0.75} if n % 2 else {})} for n in range(4)]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cache = str(folder / "compile-cache")
    outs = []
    for name in ("cold", "warm"):
        out = str(folder / name)
        result = run_cli(["run", "--prompts", str(folder / "prompts.jsonl"), "--out", out, "--model", "tiny",
                          "--hosts", "2", "--devices-per-host", "1", "--sizes", "32x32,24x32",
                          "--steps", "1", "--per-device-batch", "1", "--batches-per-slice", "1", "--no-progress",
                          "--compile-cache", cache], model_cache)
        assert result.returncode == 0, result.stderr[-3000:]
        outs.append(out)
    return outs


def _events(out: str, name: str) -> list[dict]:
    """The events ``name`` of a run's host logs."""
    from pipeline.core import logs, naming
    from pipeline.io import storage

    return [e for path in storage.glob(naming.join(out, "logs", "host-*.log"))
            for e in map(logs.parse, storage.read_text(path).splitlines()) if e and e["event"] == name]


def _ready(out: str) -> dict[int, dict]:
    """{host: its host_ready event} of a run's host logs."""
    return {e["host"]: e for e in _events(out, "host_ready")}


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
    # the second size's program: compiled and written cold, loaded warm, on every host
    for out, compiled in zip(cold_and_warm, (True, False)):
        made = _events(out, "size_ready")
        assert sorted(e["host"] for e in made) == [0, 1] and {e["size"] for e in made} == {"24x32"}
        assert all((e["sampler_compiles"] >= 1, e["from_cache"]) == (compiled, not compiled) for e in made)
        if not compiled:
            assert all(e["sampler_compiles"] == 0 and e["compiles"] == 0 for e in made)
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

    def run_local(settings, hosts, beam_args, progress, compile_cache, overwrite, gallery=None):
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

    from pipeline.model.loading import identity
    from pipeline.model.loading.checkpoint import ModelError
    from pipeline.model import load as model_load

    directory = str(tmp_path / "model")
    shutil.copytree(model_load.resolve("tiny"), directory)
    planned = identity.fingerprint(directory)
    table = identity.file_table(directory)
    assert planned == identity.fingerprint(directory) and len(table) > 5

    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file).startswith(directory):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    identity.check_files(directory, table)
    assert opened == []

    weights = os.path.join(directory, "unet", "diffusion_pytorch_model.safetensors")
    data = bytearray(open(weights, "rb").read())
    data[-1] ^= 1  # same size, other bytes
    with real_open(weights, "wb") as f:
        f.write(data)
    with pytest.raises(ModelError, match="unet/diffusion_pytorch_model.safetensors differs"):
        identity.check_files(directory, table)
    with real_open(weights, "ab") as f:
        f.write(b"x")
    with pytest.raises(ModelError, match="unet/diffusion_pytorch_model.safetensors has"):
        identity.check_files(directory, table)
