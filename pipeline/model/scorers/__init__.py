"""Scorer models: what ``--score`` computes on the devices that made the images.

One module per role: ``clip`` (CLIP's prompt and image embeddings), ``preprocess`` (CLIP's
image preprocessing, on the device, as PIL does it), ``aesthetic`` (LAION's aesthetic head),
``safety`` (diffusers' safety checker, our own Flax module), ``presets`` (built-in random
scorers) and ``models`` (where each model comes from, its fingerprint, loading a run's set).
The scoring program itself is ``pipeline.generate.scoring``.
"""
