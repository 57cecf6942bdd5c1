from setuptools import find_packages, setup

setup(
    name="promptmill",
    version="0.1.0",
    # the model families' titles, as the registry has them (tests/families/test_scratch_family.py checks it)
    description="Generate image datasets from text prompts with diffusion models (SD 1.x/2.x, SDXL, FLUX.1, "
                "FLUX.2 [klein], Z-Image) in JAX/Flax on TPU pods.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",  # jax 0.11 dropped 3.11 (README, .python-version)
    packages=find_packages(include=["pipeline", "pipeline.*", "jobs", "jobs.*"]),
    install_requires=[
        # jax from PyPI is the CPU build; the `tpu` extra adds the TPU runtime. <0.13: the compile
        # cache's codec (pipeline/generate/compile_cache/codec.py) reads jax._src, which changes
        # without notice between releases; a new jax minor is taken once its tests pass on it.
        "jax>=0.12,<0.13",
        "flax>=0.12.7",  # flax before 0.12.7 calls jax.device_put_replicated, gone since jax 0.10
        # every network is promptmill's own (no diffusers, no transformers); the tokenisers
        # come from Hugging Face's tokenizers, checkpoints by hub id from huggingface-hub
        "tokenizers>=0.20",
        "huggingface-hub>=0.24",
        "apache-beam>=2.60",
        "google-cloud-storage>=2.14",
        "filelock>=3.12",  # one download of a gs:// checkpoint per machine (pipeline.model.loading.cache)
        "numpy>=2.2",  # what jax 0.12 needs
        "pillow>=10",
        "pyarrow>=14",
        "tqdm>=4.60",
        "pyyaml>=6",  # submit gke renders JobSet manifests
        "safetensors>=0.4",  # PyTorch weights, LoRA files and the converted weights (pipeline.model.loading.weights)
        "jinja2>=3.1",  # a checkpoint's own chat template (FLUX.2 [klein]'s Qwen3 prompts)
        "tensorstore>=0.1.60",  # the zarr format
        "zarr>=3.1",  # OUT/zarr/key: tensorstore has no string dtype (formats.write_zarr_keys)
    ],
    extras_require={
        # the TPU runtime for hosts on TPU VMs, and libtpu's compiler for the TPU check of
        # `submit` and `bench tpu`, which compiles TPU programs on a machine without a TPU
        "tpu": ["jax[tpu]>=0.12,<0.13"],
        # gs:// inside the Beam pipelines (plan, collect) and Dataflow; hosts need only google-cloud-storage
        "gcp": ["apache-beam[gcp]>=2.60"],
        # `bench generator --parts sweep` times the seed notebook's FlaxStableDiffusionPipeline:
        # diffusers' last release with Flax, and transformers' last major with Flax
        "notebook": ["diffusers==0.39.*", "transformers>=4.57,<5"],
        "test": ["apache-beam[gcp]>=2.60", "pytest>=8", "pytest-timeout>=2.2", "gcp-storage-emulator>=2024.8",
                 # the suite compiles real TPU programs for the TPU check (libtpu, no TPU needed)
                 "jax[tpu]>=0.12,<0.13",
                 "webdataset>=0.2",
                 # pytest.ini runs the suite on two worker processes
                 "pytest-xdist>=3.6",
                 # metadata.parquet must load in Hugging Face datasets; <5.1 keeps huggingface-hub<1, which the
                 # notebook extra's transformers 4 needs, so that the extras install together
                 "datasets>=3,<5.1",
                 # the rendered GKE manifests are checked against Kubernetes' own object schemas
                 "kubernetes-validate>=1.30",
                 # OUT/zarr must open in xarray (a zarr v3 group with dimension names)
                 "xarray>=2025.1", "zarr>=3"],
    },
    entry_points={"console_scripts": ["promptmill=jobs.cli:entry"]},
)
