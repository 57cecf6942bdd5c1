"""The plan's first pass as Beam steps: each file scanned, the duplicate checks run by
hash range, and each file counted, so that no step holds a record of every file and no
rejected row crosses the runner (a runner may hold a step's whole output: Beam's
DirectRunner holds it in its one process, decoded and encoded):

  ScanFiles     each file -> its scan (``layout.scan_file``), saved without its hashes,
                and its hashes in sections sorted by hash (``duplicates.section``); out go
                (file, what it saved) and, per hash range it has rows in, a ``Segment``
  CheckIds      each range's id segments, read in one ranged request each -> the rows
                whose id an earlier row has (``duplicate_id``), by file, and with --dedupe
                where the prompt check must leave those rows out, by prompt range: written
                in one object for the range (``naming.plan_range``); out go pieces of it
  CheckPrompts  (--dedupe) each range's prompt segments, less the rows of the id check's
                pieces for it -> the rows whose prompt an earlier kept row has
                (``duplicate_prompt``), by file, written alike
  CountFiles    each file with the pieces of its rows rejected -> its ``FileCounts`` (to
                the layout) and its ``Drops``, written for its placing step, which reads
                only its own (``naming.plan_section`` "drops"); its scan and sections are
                deleted

A piece is (path, first byte, length) of an object (``beamio.read_pieces``): a few per
file and range cross the runner, whatever the rejects. ``FirstPass`` composes the steps:
files -> (counts, (file, its drops' object or None), the objects to delete once read).
"""
from __future__ import annotations

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from pipeline.core import naming
from pipeline.io import beamio
from pipeline.plan import duplicates
from pipeline.plan.duplicates import Drops, Segment
from pipeline.plan.layout import count_file, load_scan, save_scan, scan_file

# what travels where, each value tagged with its kind, so that one GroupByKey gathers several kinds;
# TEMPS: objects deleted once the plan's key index is written
IDS, PROMPTS, EXCLUDED, SAVED, COUNTS, TEMPS = "ids", "prompts", "excluded", "saved", "counts", "temps"


class _ScanFn(beam.DoFn):
    """Scans one file; saves its arrays and its sorted sections (the Beam runner never
    holds, copies or pickles them) and yields where they are."""

    def __init__(self, out: str, args: tuple, sizes: tuple[str, ...], dedupe: bool, *, default_guidance: float,
                 rule: str, ranges: int):
        self.out, self.args, self.sizes, self.dedupe = out, args, sizes, dedupe
        self.default_guidance, self.rule, self.ranges = default_guidance, rule, ranges
        self.read = Metrics.counter("plan", "rows_read")

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, path: str):
        scan = scan_file(path, *self.args, dedupe=self.dedupe, default_guidance=self.default_guidance,
                         rule=self.rule, sizes=self.sizes)
        self.read.inc(scan.rows)
        saved = [naming.plan_scan(self.out, path)]
        save_scan(scan, saved[0])
        kinds = [(IDS, duplicates.section(scan.id_hashes, scan.lines,
                                          scan.prompt_hashes if self.dedupe else None))]
        if self.dedupe:
            kinds.append((PROMPTS, duplicates.section(scan.prompt_hashes, scan.lines)))
        for kind, rows in kinds:
            if not len(rows):
                continue
            section = naming.plan_section(self.out, path, kind)
            duplicates.write_section(section, rows)
            saved.append(section)
            for r, start, stop in duplicates.segments(rows, self.ranges):
                yield beam.pvalue.TaggedOutput(kind, (r, (kind, Segment(path, section, start, stop))))
        yield path, (SAVED, saved)


class _CheckFn(beam.DoFn):
    """One hash range's check (``duplicates.check_range``) of its segments (``kind``), less
    the rows of the id check's pieces for it: writes what it finds in one object and
    yields (file, (kind, piece of its ``Drops``)) and the object (``TEMPS``); the id
    check with --dedupe also yields (prompt range, (EXCLUDED, piece)) of the rows it
    rejects, by file (``duplicates.lines_to_bytes``)."""

    def __init__(self, out: str, kind: str, dtype, ranges: int, exclude: bool = False):
        self.out, self.kind, self.dtype, self.ranges, self.exclude = out, kind, dtype, ranges, exclude
        self.reason = "duplicate_id" if kind == IDS else "duplicate_prompt"

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, element):
        hash_range, grouped = element
        segments, left_out = [], []
        for kind, value in grouped:
            (segments if kind == self.kind else left_out).append(value)
        read = beamio.read_pieces([duplicates.piece_of(s, self.dtype) for s in segments])
        parts = [(s.source, np.frombuffer(data, self.dtype)) for s, data in zip(segments, read)]
        excluded = {}
        for data in beamio.read_pieces(left_out):
            for source, lines in duplicates.lines_from_bytes(data).items():
                excluded.setdefault(source, []).append(lines)
        excluded = {source: np.concatenate(lines) for source, lines in excluded.items()}
        found, where = duplicates.check_range(parts, self.reason, excluded)
        if not found:
            return
        sources = sorted(found)
        left = {}  # prompt range -> {file: its rows rejected here}
        if self.exclude:
            rows_of = dict(parts)
            for source in sources:
                for r, lines in duplicates.exclusions(rows_of[source], where[source], self.ranges).items():
                    left.setdefault(r, {})[source] = lines
        path = naming.plan_range(self.out, self.kind, hash_range)
        pieces = beamio.write_pieces(path, [found[source].to_bytes() for source in sources] +
                                     [duplicates.lines_to_bytes(left[r]) for r in sorted(left)])
        for source, piece in zip(sources, pieces):
            yield source, (self.kind, piece)
        for r, piece in zip(sorted(left), pieces[len(sources):]):
            yield beam.pvalue.TaggedOutput(EXCLUDED, (r, (EXCLUDED, piece)))
        yield beam.pvalue.TaggedOutput(TEMPS, path)


class _CountFn(beam.DoFn):
    """One file, once both checks are done: its counts, and its drops written for its
    placing step: (file, the drops' object, or None when it has none)."""

    def __init__(self, out: str, num_buckets: int):
        self.out, self.num_buckets = out, num_buckets

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, element):
        source, grouped = element
        [saved] = [value for kind, value in grouped if kind == SAVED]
        pieces = [value for kind, value in grouped if kind != SAVED]
        drops = Drops.merged([Drops.from_bytes(data) for data in beamio.read_pieces(pieces)])
        yield beam.pvalue.TaggedOutput(COUNTS, count_file(load_scan(saved[0]), drops, self.num_buckets))
        beamio.delete(saved)  # every range has read its segments: the checks are a step before
        if not len(drops):
            yield source, None
            return
        path = naming.plan_section(self.out, source, "drops")
        beamio.write_bytes(path, drops.to_bytes())
        yield source, path


class FirstPass(beam.PTransform):
    """Files (paths) -> (every file's ``FileCounts``, (file, its ``Drops``' object or None)
    per file, the PCollections of the objects the checks wrote, to delete once read).

    ``args``: (run seed, input root, prompt field); ``ranges``: the hash ranges of the
    duplicate checks (``duplicates.range_count``)."""

    def __init__(self, out: str, args: tuple, settings, ranges: int):
        super().__init__()
        self.out, self.args, self.settings, self.ranges = out, args, settings, ranges

    def expand(self, files):
        s, ranges, out = self.settings, self.ranges, self.out
        scan = _ScanFn(out, self.args, s.sizes, s.dedupe, default_guidance=s.guidance_scale, rule=s.guidance_rule,
                       ranges=ranges)
        scanned = files | "ScanFiles" >> beam.ParDo(scan).with_outputs(IDS, PROMPTS, main=SAVED)
        id_dtype = duplicates.ID_ROW_WITH_PROMPT if s.dedupe else duplicates.ROW
        ids = (scanned[IDS]
               | "IdRanges" >> beam.GroupByKey()
               | "CheckIds" >> beam.ParDo(_CheckFn(out, IDS, id_dtype, ranges, s.dedupe))
               .with_outputs(EXCLUDED, TEMPS, main=IDS))
        by_file, temps = [scanned[SAVED], ids[IDS]], [ids[TEMPS]]
        if s.dedupe:
            prompts = ((scanned[PROMPTS], ids[EXCLUDED])
                       | "PromptsAndLeftOut" >> beam.Flatten()
                       | "PromptRanges" >> beam.GroupByKey()
                       | "CheckPrompts" >> beam.ParDo(_CheckFn(out, PROMPTS, duplicates.ROW, ranges))
                       .with_outputs(TEMPS, main=PROMPTS))
            by_file.append(prompts[PROMPTS])
            temps.append(prompts[TEMPS])
        counted = (by_file
                   | "AllOfAFile" >> beam.Flatten()
                   | "ByFile" >> beam.GroupByKey()
                   | "CountFiles" >> beam.ParDo(_CountFn(out, max(1, len(s.sizes)))).with_outputs(COUNTS,
                                                                                                  main="drops"))
        return counted[COUNTS], counted.drops, tuple(temps)
