"""Whether a checkpoint has the pieces its family needs: every component folder, each
weight-holding component's config and weights, the scheduler's config (``check_components``).
A ``gs://`` checkpoint's configs-only copy is checked against its listing, whose weights
are listed but not downloaded.
"""
from __future__ import annotations

import os

from pipeline.model.loading import builtin, weights
from pipeline.model.loading.checkpoint import ModelError, read_json_file
from pipeline.model.loading.fetch import configs_only, remote_objects


def check_components(directory: str, components, libraries: dict) -> None:
    """Check that every component folder a checkpoint's family needs (``components``) is
    present, and that each one holding weights (``libraries``: {component: library})
    has its config and weights; ModelError naming the first missing piece."""
    objects = remote_objects(directory)
    # a gs:// checkpoint's configs-only copy: its listing says which files it has
    names = set(objects) if objects is not None and configs_only(directory) else None
    index = read_json_file(os.path.join(directory, "model_index.json"))
    for component in components:
        present = os.path.isdir(os.path.join(directory, component)) if names is None else \
            any(name.startswith(f"{component}/") for name in names)
        if component not in index or not present:
            raise ModelError(f"{directory}: missing component '{component}/'")
    for component, library in libraries.items():
        sub = os.path.join(directory, component)
        if not os.path.isfile(os.path.join(sub, "config.json")):
            raise ModelError(f"{directory}: missing {component}/config.json")
        if builtin.shapes_only(directory):
            continue  # a built-in with its configs alone: shapes, never weights
        try:
            if names is None:
                weights.find(sub, component, library)
            else:
                _findlisted(sub, component, library, names)
        except weights.WeightsError as e:
            raise ModelError(str(e)) from None
    if "scheduler" in components and not os.path.isfile(os.path.join(directory, "scheduler",
                                                                     "scheduler_config.json")):
        raise ModelError(f"{directory}: missing scheduler/scheduler_config.json")


def _findlisted(component_dir: str, component: str, library: str, names: set) -> None:
    """``weights.find`` for a component whose weights are listed but not downloaded."""
    files = weights.weight_file_names(library)
    if not any(f"{component}/{name}" in names for name in files):
        raise weights.WeightsError(f"{component_dir}: no weights for '{component}' (expected {' or '.join(files)})")
