"""The plan's first pass as Beam steps: each file scanned, the duplicate checks run by
hash range, and each file counted, so that no step holds a record of every file.

  ScanFiles     each file -> its scan (``layout.scan_file``), saved without its hashes,
                and its hashes in sections sorted by hash (``duplicates.section``); out go
                (file, what it saved) and, per hash range it has rows in, a ``Segment``
  CheckIds      each range's id segments, read in one ranged request each -> the rows
                whose id an earlier row has (``duplicate_id``), by file; with --dedupe
                also where the prompt check must leave those rows out
  CheckPrompts  (--dedupe) each range's prompt segments, less those rows -> the rows
                whose prompt an earlier kept row has (``duplicate_prompt``), by file
  CountFiles    each file with its rows rejected -> its ``FileCounts`` (to the layout)
                and its ``Drops`` (to its placing step, which reads only its own); its
                scan and sections are deleted

``FirstPass`` composes them: files -> (counts, (file, drops)).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from pipeline.core import naming
from pipeline.io import beamio
from pipeline.plan import duplicates
from pipeline.plan.duplicates import Drops, Segment
from pipeline.plan.layout import count_file, load_scan, save_scan, scan_file

# A range reads one segment of every file with rows in it: on GCS, ranged reads in parallel,
# which the requests' latency needs. Local files are read one after the other: each thread
# allocates in its own malloc arena, which keeps the memory once freed (a 10M-prompt plan
# with --dedupe peaked 240 MiB higher with 16 reader threads).
READERS = 16
# what travels where, each value tagged with its kind, so that one GroupByKey gathers several kinds
IDS, PROMPTS, EXCLUDED, SAVED, COUNTS = "ids", "prompts", "excluded", "saved", "counts"


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
    the rows the id check left out: yields (file, (kind, ``Drops``)); the id check with
    --dedupe also yields (prompt range, (EXCLUDED, (file, lines))) of the rows it rejects."""

    def __init__(self, kind: str, dtype, ranges: int, exclude: bool = False):
        self.kind, self.dtype, self.ranges, self.exclude = kind, dtype, ranges, exclude
        self.reason = "duplicate_id" if kind == IDS else "duplicate_prompt"

    def setup(self):
        beamio.use_emulator_credentials()
        self.pool = ThreadPoolExecutor(READERS, thread_name_prefix="segments")

    def teardown(self):
        self.pool.shutdown()

    def process(self, element):
        _, grouped = element
        segments, left_out = [], []
        for kind, value in grouped:
            (segments if kind == self.kind else left_out).append(value)
        remote = any(s.path.startswith("gs://") for s in segments)
        parts = list(zip((s.source for s in segments), (self.pool.map if remote else map)(
            lambda s: duplicates.read_segment(s, self.dtype), segments)))
        excluded = {}
        for source, lines in left_out:
            excluded.setdefault(source, []).append(lines)
        excluded = {source: np.concatenate(lines) for source, lines in excluded.items()}
        found, where = duplicates.check_range(parts, self.reason, excluded)
        rows_of = dict(parts)
        for source, drops in found.items():
            yield source, (self.kind, drops)
            if self.exclude:
                for r, lines in duplicates.exclusions(rows_of[source], where[source], self.ranges).items():
                    yield beam.pvalue.TaggedOutput(EXCLUDED, (r, (EXCLUDED, (source, lines))))


class _CountFn(beam.DoFn):
    """One file, once both checks are done: its counts, and its drops for its placing step."""

    def __init__(self, num_buckets: int):
        self.num_buckets = num_buckets

    def setup(self):
        beamio.use_emulator_credentials()

    def process(self, element):
        source, grouped = element
        [saved] = [value for kind, value in grouped if kind == SAVED]
        drops = Drops.merged([value for kind, value in grouped if kind != SAVED])
        yield beam.pvalue.TaggedOutput(COUNTS, count_file(load_scan(saved[0]), drops, self.num_buckets))
        beamio.delete(saved)  # every range has read its segments: the checks are a step before
        yield source, drops


class FirstPass(beam.PTransform):
    """Files (paths) -> (every file's ``FileCounts``, (file, its ``Drops``) per file).

    ``args``: (run seed, input root, prompt field); ``ranges``: the hash ranges of the
    duplicate checks (``duplicates.range_count``)."""

    def __init__(self, out: str, args: tuple, settings, ranges: int):
        super().__init__()
        self.out, self.args, self.settings, self.ranges = out, args, settings, ranges

    def expand(self, files):
        s, ranges = self.settings, self.ranges
        scan = _ScanFn(self.out, self.args, s.sizes, s.dedupe, default_guidance=s.guidance_scale, rule=s.guidance_rule,
                       ranges=ranges)
        scanned = files | "ScanFiles" >> beam.ParDo(scan).with_outputs(IDS, PROMPTS, main=SAVED)
        id_dtype = duplicates.ID_ROW_WITH_PROMPT if s.dedupe else duplicates.ROW
        ids = (scanned[IDS]
               | "IdRanges" >> beam.GroupByKey()
               | "CheckIds" >> beam.ParDo(_CheckFn(IDS, id_dtype, ranges, s.dedupe)).with_outputs(EXCLUDED, main=IDS))
        by_file = [scanned[SAVED], ids[IDS]]
        if s.dedupe:
            by_file.append((scanned[PROMPTS], ids[EXCLUDED])
                           | "PromptsAndLeftOut" >> beam.Flatten()
                           | "PromptRanges" >> beam.GroupByKey()
                           | "CheckPrompts" >> beam.ParDo(_CheckFn(PROMPTS, duplicates.ROW, ranges)))
        counted = (by_file
                   | "AllOfAFile" >> beam.Flatten()
                   | "ByFile" >> beam.GroupByKey()
                   | "CountFiles" >> beam.ParDo(_CountFn(max(1, len(s.sizes)))).with_outputs(COUNTS, main="drops"))
        return counted[COUNTS], counted.drops
