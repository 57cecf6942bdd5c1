import os
import sys

import pytest

# Tests that build a Generator in-process use two CPU devices; the flag must be set
# before JAX starts its CPU backend (host processes get theirs from the launcher, and
# inherit the rest). The suite compiles hundreds of small programs, so XLA's CPU
# backend compiles them without LLVM's optimisation passes (measured again on jaxlib
# 0.12.0.1, farm-bench, 3 runs each side by side: tests/generate/test_generator.py takes
# 21.4 CPU-s with these flags against 36.5 with XLA's defaults, 0.59x).
# XLA aborts a process on a flag it does not know: jaxlib 0.12 has no
# --xla_cpu_use_fusion_emitters any more (its MLIR fusion emitters are the only ones), so
# the suite no longer sets it (tests/test_flags.py checks every flag here against the
# installed jaxlib). The HLO compiled is the same, but its
# float rounding may differ from the default's by a pixel level, so every comparison in
# the suite is between programs compiled alike, or within a tolerance; the README's demo
# runs with the defaults.
SUITE_XLA_FLAGS = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", SUITE_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the CPU backend's thread count, pinned as every promptmill process pins it (tests that
# compare a 1x4 run with a 2x2 one, in-process generators with host processes' images)
from pipeline.generate import environment as _environment  # noqa: E402

_environment.pin_cpu_threads()
# The suite starts a few hundred Python processes (hosts, launchers, workers): each reads
# its imports' bytecode from the __pycache__ folders the first one wrote, even where the
# environment says not to write them (PYTHONDONTWRITEBYTECODE), so the install need not
# compile the whole of every dependency ahead of time.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the suite's folder: test modules sit in folders below it that mirror the package, so their
# paths (fixtures, the repository) start here, never at their own __file__
TESTS = os.path.join(ROOT, "tests")


# The modules that run whole jobs (subprocess runs, Beam pipelines, compilation), slowest
# first. The others (pure functions, transforms, a model at most) run before them, so a
# broken basic fails within the first minute. pytest.ini hands each module to one
# pytest-xdist worker as a unit (--dist loadscope, so a module's shared runs happen once),
# in this order (--no-loadscope-reorder): the longest start first, and the worker that
# finishes early takes the shorter ones, so neither waits alone on a long module at the end.
# Each is a module's path below tests/ (a module named here that is not there is a test failure:
# tests/test_suite.py).
# (Measured on two workers of a 2-core machine, in seconds: test_e2e 315, test_bench 135,
# test_tpu_check 114, test_readme 110, test_parity 83, test_e2e_gcs 83, test_stop 78.)
SLOW_MODULES = [
    "e2e/test_e2e.py",
    "bench/test_bench.py",
    "generate/test_tpu_check.py",
    "test_readme.py",
    "e2e/test_e2e_gcs.py",
    "generate/test_stop.py",
    "core/test_buckets.py",
    "families/test_pipeline_parity.py",
    "engines/test_beam_engine.py",
    "families/test_flux.py",
    "families/test_flux2_pipeline.py",
    "families/test_zimage.py",
    "cloud/test_submit_gke.py",
    "cloud/test_submit_dataflow.py",
    "cloud/test_submit.py",
    "model/test_attention.py",
    "generate/test_compile_cache.py",
    "generate/test_decode_batch.py",
    "model/test_fsdp.py",
    "generate/test_generator.py",
    "collect/test_dataset.py",
    "generate/test_latents.py",
    "cloud/test_schedule.py",
    "model/test_lora.py",
    "generate/test_fit.py",
    "model/test_scorers.py",
    "generate/test_bf16.py",
    "families/test_flux_nets.py",
    "families/test_flux_sampling.py",
    "model/test_model_sources.py",
    "generate/test_host_pipeline.py",
    "families/test_flux_lora.py",
    "bench/test_plan_bench.py",
    "io/test_beamio.py",
    "model/test_weights.py",
    "families/test_tiny_flux.py",
]


def pytest_collection_modifyitems(items):
    """Fast modules first, in their usual order, then SLOW_MODULES in the listed order.

    The sort is stable: the tests of a module keep their order and stay together."""
    def rank(item):
        name = os.path.relpath(os.path.realpath(item.path), os.path.realpath(TESTS))
        return SLOW_MODULES.index(name) + 1 if name in SLOW_MODULES else 0

    items.sort(key=rank)


@pytest.fixture(scope="session")
def _programs_folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax-programs"))


@pytest.fixture(autouse=True)
def _programs_kept(_programs_folder):
    """JAX's persistent compilation cache for the programs this worker compiles in-process.

    Many tests build a generator of the same tiny program (same model, size, steps and
    batch) anew, and a new jitted function compiles again where the cache finds the same
    program text: a sixth less time for the modules that build generators. Only programs
    that took at least half a second to compile are kept (samplers, not the small
    programs whose compilation some tests count), and a cache hit is the executable XLA
    compiled for that program. A test that points jax at a cache folder of its own, or
    turns the cache off, gets this worker's folder back before the next test; host
    processes are unaffected (each run has its own --compile-cache)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    config = jax.config.values
    wanted = {"jax_compilation_cache_dir": _programs_folder, "jax_enable_compilation_cache": True,
              "jax_persistent_cache_min_compile_time_secs": 0.5, "jax_persistent_cache_min_entry_size_bytes": 0}
    if any(config[name] != value for name, value in wanted.items()):
        if config["jax_compilation_cache_dir"] not in (None, _programs_folder):
            compilation_cache.reset_cache()
        for name, value in wanted.items():
            jax.config.update(name, value)
    yield


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One cache folder for the whole session, so the tiny model is built once.

    Under pytest-xdist each worker has its own cache (its compile-cache mirrors are keyed
    by gs:// paths that every worker's emulator shares), but the workers share one
    ``models`` folder, where the first builds the tiny model while the others wait for it.
    Models are written to a scratch folder and renamed into place, so sharing is safe.
    """
    import fcntl

    path = str(tmp_path_factory.mktemp("promptmill-cache"))
    os.environ["PROMPTMILL_CACHE"] = path
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent  # the run's root, above each worker's
        shared = root / "promptmill-models"
        shared.mkdir(exist_ok=True)
        os.symlink(shared, os.path.join(path, "models"))
        from pipeline.model import load

        with open(shared / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            load.resolve("tiny")
    return path


# libraries no host may import: promptmill's networks are its own (neither diffusers' nor
# transformers' Flax classes, removed from both libraries) and the package never needs torch
NOT_ON_HOSTS = frozenset({"diffusers", "transformers", "torch"})


def run_cli(args, cache, timeout=600, env=None):
    """Run ``python -m jobs.cli ARGS`` in a subprocess; returns CompletedProcess, with
    ``host_modules``: the top-level packages its host processes (``generate``) imported,
    as each recorded them (``tests/host_modules``; empty where no host ran)."""
    import glob
    import json
    import subprocess
    import tempfile

    full_env = dict(os.environ if env is None else env, PROMPTMILL_CACHE=cache)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "tests", "host_modules"),
                                                           full_env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="promptmill-modules-") as records:
        full_env["PROMPTMILL_TEST_MODULES"] = records
        result = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=full_env,
                                capture_output=True, text=True, timeout=timeout)
        result.host_modules = set()
        for path in glob.glob(os.path.join(records, "*.txt")):
            with open(path, encoding="utf-8") as f:
                argv, *names = f.read().splitlines()
            if json.loads(argv)[1:2] == ["generate"]:
                result.host_modules.update(names)
    return result


def check_host_imports(result):
    """The run's hosts generated (they imported jax) without any of ``NOT_ON_HOSTS``."""
    assert "jax" in result.host_modules, "no host recorded its imports"
    assert not NOT_ON_HOSTS & result.host_modules, sorted(NOT_ON_HOSTS & result.host_modules)


def rewritten(tmp_path, source, change, name="lora.safetensors"):
    """A copy of the safetensors file ``source`` under ``tmp_path``, its tensors (a dict,
    header metadata kept) changed in place by ``change``; returns its path."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(source, "np") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        metadata = f.metadata()
    change(tensors)
    path = str(tmp_path / name)
    save_file(tensors, path, metadata=metadata)
    return path


@pytest.fixture(scope="session")
def gcs_emulator():
    """A GCS emulator on a free 127.0.0.1 port, with every GCS client pointed at it.

    Yields the name of a fresh bucket. (The emulator does not enforce preconditions,
    so no test relies on them.)
    """
    from pipeline.testing import emulator

    with emulator.running("promptmill-test"):
        yield "promptmill-test"
