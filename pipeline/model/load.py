"""Loading a diffusers-format checkpoint: the narrow model interface.

Every model, ``--model tiny`` included, is a diffusers-format directory found by
``pipeline.model.loading.resolve`` (fetched by ``loading.fetch``, pinned by
``loading.identity``, checked by ``loading.components``); its ``model_index.json`` says its family
(``pipeline.model.families``: SD 1.x/2.x, SDXL, FLUX.1), which loads it (``load``) and
describes it for a plan (``describe``). The rest of promptmill sees only ``Model`` and
calls its family.
"""
from __future__ import annotations

import dataclasses
import os

from pipeline.core.choices import DTYPES
from pipeline.core.settings import parse_lora
from pipeline.model import families
from pipeline.model.loading import builtin, fetch, identity, lora
from pipeline.model.loading import resolve as resolving
from pipeline.model.families.base import Described, LoadRequest, Model
from pipeline.model.loading.checkpoint import ModelError, read_json_file
from pipeline.model.loading.fetch import resolve_lora
from pipeline.model.loading.identity import file_sha256, model_fingerprint
from pipeline.model.loading.components import check_components

__all__ = ["LoadRequest", "Model", "ModelError", "describe", "family_of", "load", "resolve", "with_sampler"]


def resolve(name: str, weights: bool = True, shapes: bool = False) -> str:
    """The local diffusers-format directory for ``--model``: a built-in random model's
    name (built once per machine, ``families.builtin_folder``), or a local folder, a
    ``gs://`` prefix or a Hugging Face id (``loading.resolve.resolve``).
    ``weights=False``: for a ``gs://`` prefix, a folder of its configs alone, enough to
    describe the model;
    ``shapes`` (with ``weights=False``): a built-in model not built yet may be its configs
    alone too, for what needs its shapes only; a plan, whose fingerprint the hosts check
    against the whole model, never asks for that."""
    if name in families.BUILTINS:
        return families.builtin_folder(name, shapes=shapes and not weights)
    try:
        return resolving.resolve(name, weights)
    except ModelError as e:
        raise ModelError(f"{e}; or one of the built-in random models: {', '.join(families.BUILTINS)}") from None


def family_of(directory: str) -> tuple[families.Family, dict]:
    """(the checkpoint's family, its model_index.json), its components checked present."""
    index_path = os.path.join(directory, "model_index.json")
    if not os.path.isfile(index_path):
        raise ModelError(f"{directory}: missing model_index.json (not a diffusers-format checkpoint)")
    index = read_json_file(index_path)
    try:
        family = families.detect(index, directory)
    except families.FamilyError as e:
        raise ModelError(str(e)) from None
    check_components(directory, family.components(index), family.weight_libraries(index))
    return family, index


def request_of(request: LoadRequest | str, **fields) -> LoadRequest:
    """``request`` itself, or a ``LoadRequest`` for the model named ``request`` with
    ``fields`` (``LoadRequest``'s); a ``LoadRequest`` and fields are not given together."""
    if isinstance(request, LoadRequest):
        if fields:
            raise TypeError(f"a LoadRequest is given whole: {', '.join(fields)} given beside it")
        return request
    given = {name: value for name, value in fields.items() if value is not None}
    if "loras" in given:
        given["loras"] = tuple(given["loras"])
    return LoadRequest(request, **given)


def load(request: LoadRequest | str, *, abstract: bool = False, fingerprint: bool = True, **fields) -> Model:
    """Load ``--model`` (a built-in random model, or a diffusers-format directory) for
    sampling, as ``request`` asks (a ``LoadRequest``, or a model's name and
    ``LoadRequest``'s fields: ``request_of``).

    ``dtype`` is the compute and weight dtype of the networks (``fp32`` or ``bf16``);
    latents and the samplers always stay in float32. ``scheduler`` and
    ``timestep_spacing``: the run's choices (None: the checkpoint's own), resolved by its
    family. ``unet``: a UNet-only safetensors file (local or gs://) whose weights replace
    the checkpoint's (``--unet``). ``loras``: the ``--lora`` specs (``PATH[@SCALE]``),
    merged in order (``pipeline.model.loading.lora``); they change parameter values only,
    never the compiled program. ``max_sequence_length``: the family's text length (None:
    its default).

    ``abstract``: the same model with its networks' params as ``jax.ShapeDtypeStruct``s,
    from the configs alone (no weight read, no adapter merged): enough to lower and compile
    its programs. ``fingerprint=False``: the model's fingerprint is left None (not
    computed: the caller checks the files another way, ``identity.check_files``).
    """
    request = request_of(request, **fields)
    if request.dtype not in DTYPES:
        raise ModelError(f"--dtype must be one of {', '.join(DTYPES)}, got {request.dtype!r}")
    directory = resolve(request.model, weights=not abstract, shapes=abstract)  # shapes come from the configs alone
    family, _ = family_of(directory)
    if not abstract and builtin.shapes_only(directory):
        raise ModelError(f"model {request.model!r} is a shapes-only built-in model: its weights are never written, "
                         f"so it can be compiled and measured (the TPU check, `promptmill bench`) but not run; use "
                         f"{', '.join(families.runnable_builtins())} to run a random model")
    # --unet and --lora change values, never shapes: an abstract model reads neither
    unet_file = None if abstract else _unet_file(directory, family, request.unet)
    adapters = [] if abstract else _resolved_loras(request.loras)
    model = family.load(directory, request, unet_file, [(local, scale) for _, local, scale in adapters], abstract)
    value = None if abstract or not fingerprint else model_fingerprint(
        directory, unet_file, [(local, scale) for _, local, scale in adapters])
    return dataclasses.replace(model, fingerprint=value, native_size=default_size(request.model, model.native_size))


def default_size(model: str, native: int) -> int:
    """The side of ``model``'s images when a run gives none: a built-in model's own
    ``default_size`` (a tiny model's is small: it exists for tests and demos), else its
    family's ``native`` size, as the reference pipeline's default."""
    family = families.BUILTINS.get(model)
    return family.builtins()[model].get("default_size", native) if family is not None else native


def with_sampler(model: Model, scheduler: str | None, timestep_spacing: str | None = None) -> Model:
    """The same networks and weights (nothing reloaded) with another sampler, resolved as
    ``load`` resolves it (``Family.with_sampler``: a family with one sampler refuses)."""
    return model.family.with_sampler(model, resolve(model.path), scheduler, timestep_spacing)


def model_table(name: str) -> dict:
    """The table the plan writes for hosts to check ``--model`` against (``check_model``):
    for a gs:// prefix its objects' {"size", "md5", "crc32c"} from the listing (nothing
    downloaded); else ``identity.file_table`` of the local folder."""
    from pipeline.io import storage

    return fetch.listed(name) if storage.is_gcs(name) else identity.file_table(resolve(name))


def check_model(name: str, table: dict) -> None:
    """ModelError naming the first file of ``--model`` that differs from the plan's
    ``table`` (``model_table``).

    A gs:// checkpoint planned by its checksums is checked by listing it again
    (``identity.check_objects``: no byte read; the host's copy is the one keyed by those
    checksums, checked as it downloaded); any other by its local files (``identity.check_files``)."""
    from pipeline.io import storage

    if storage.is_gcs(name) and not any("sha256" in entry for entry in table.values()):
        identity.check_objects(name, table)
    else:
        identity.check_files(resolve(name), table)


def program_digest(name: str) -> str:
    """sha256 of what ``--model``'s programs are built from: its configs alone
    (``identity.configs_digest``). A gs:// checkpoint's configs alone are fetched for it,
    and give the digest its whole copy gives."""
    return identity.configs_digest(resolve(name, weights=False, shapes=True))


def _unet_file(directory: str, family: families.Family, unet: str | None) -> str | None:
    """The local ``--unet`` file (None without one), once checked against the checkpoint's
    UNet by its family (``Family.unet_file``: a family without a UNet refuses)."""
    if not unet:
        return None
    return family.unet_file(directory, unet)


def _resolved_loras(specs) -> list[tuple[str, str, float]]:
    """(path as given, local file, scale) of each ``--lora`` spec, in order."""
    resolved = []
    for spec in specs:
        try:
            path, scale = parse_lora(spec)
        except ValueError as e:
            raise ModelError(str(e)) from None
        resolved.append((path, resolve_lora(path), scale))
    return resolved


def _checked_loras(directory: str, family: families.Family, specs) -> list[tuple[str, str, float]]:
    """``_resolved_loras``, once each file has been read and every key matched to a layer
    of the checkpoint, with fitting shapes (from its configs: no weights are loaded)."""
    adapters = _resolved_loras(specs)
    if not adapters:
        return adapters
    try:
        read = [lora.read(local) for _, local, _ in adapters]  # headers only: an unreadable file fails first
        shapes = family.lora_shapes(directory)
        torch_names = family.lora_torch_names()
        for adapter in read:
            lora.match(adapter, shapes, torch_names)
    except lora.LoraError as e:
        raise ModelError(str(e)) from None
    return adapters


@dataclasses.dataclass(frozen=True)
class Description(Described):
    """``describe``'s answer: the family's ``Described`` of a checkpoint, with the folder
    of its configs, the run's model fingerprint (the checkpoint, --unet and --lora files)
    and each LoRA file read ({path, scale, sha256})."""
    directory: str = ""
    fingerprint: str = ""
    loras: tuple[dict, ...] = ()


def describe(request: LoadRequest | str, **fields) -> Description:
    """What planning needs to know of a model, from its configs alone (no weights loaded),
    for ``request`` (``request_of``); ``scheduler``, ``timestep_spacing``, ``steps`` and
    ``max_sequence_length``: the run's,
    checked against the checkpoint's configs by its family; ``unet``: the run's --unet
    file, checked against the checkpoint's UNet and part of the fingerprint; ``loras``: the
    run's --lora specs, each file read and matched layer by layer against the
    checkpoint's networks, and part of the fingerprint. ``loras`` in the result: {path,
    scale, sha256} of each; the rest is the family's ``Described``. Of a gs:// checkpoint
    only the configs are downloaded, and its fingerprint is its objects' checksums
    (``identity.fingerprint``)."""
    request = request_of(request, **fields)
    directory = resolve(request.model, weights=False)
    family, _ = family_of(directory)
    unet_file = _unet_file(directory, family, request.unet)
    described = family.describe(directory, request, unet_file)
    described = dataclasses.replace(described, native_size=default_size(request.model, described.native_size))
    adapters = _checked_loras(directory, family, request.loras)
    return Description(**dataclasses.asdict(described), directory=directory,
                       fingerprint=model_fingerprint(directory, unet_file,
                                                     [(local, scale) for _, local, scale in adapters]),
                       loras=tuple({"path": path, "scale": scale, "sha256": file_sha256(local)}
                                   for path, local, scale in adapters))
