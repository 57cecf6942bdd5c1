"""The plan's key index: each planned key's slice and position, bucketed by a hash of the
key (``pipeline.output.key_index``), so that ``reproduce KEY`` finds a key's slice by
reading one bucket, before collect as after it.

``PlanKeys`` reads each written slice once more (its items, not the inputs) and shuffles
its keys by bucket; it runs beside the manifest's step, which waits for it, so a written
manifest means a whole index.
"""
from __future__ import annotations

import json

import apache_beam as beam

from pipeline.core import naming
from pipeline.io import beamio
from pipeline.output import key_index


def slice_pieces(out: str, index: int, images: int) -> list[tuple[int, dict]]:
    """(bucket, {key, slice, position}) pieces of plan slice ``index`` of a run of ``images``."""
    columns = {name: [] for name in key_index.PLAN_COLUMNS}
    for raw in beamio.iter_lines(naming.plan_slice(out, index)):
        if raw.strip():
            item = json.loads(raw)
            for name in key_index.PLAN_COLUMNS:
                columns[name].append(item[name])
    return key_index.split(columns, key_index.bucket_count(images))


class PlanKeys(beam.PTransform):
    """Written slice indices (and the plan's Layout, a singleton) -> the buckets written."""

    def __init__(self, out: str, layout):
        super().__init__()
        self.out, self.layout = out, layout

    def expand(self, written):
        pieces = written | "SliceKeys" >> beam.FlatMap(
            lambda index, layout, out: slice_pieces(out, index, layout.images), beam.pvalue.AsSingleton(self.layout),
            self.out)
        out = self.out
        return key_index.write_index(pieces, lambda bucket: naming.plan_keys(out, bucket))
