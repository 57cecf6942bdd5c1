"""What every ``submit`` target launches: a run's settings on one TPU slice, and how the
submit command follows it (``DataflowJob`` and ``GkeJob`` add their own)."""
from __future__ import annotations

import dataclasses

from pipeline.cloud import tpu

DEFAULT_POLL_S = 30.0  # between two looks at a launched run's progress


@dataclasses.dataclass(frozen=True, kw_only=True)
class Submission:
    settings: object  # pipeline.core.settings.Settings, devices_per_host = a host's (a worker's) chips
    tpu_slice: tpu.TpuSlice
    overwrite: bool = False
    poll_s: float = DEFAULT_POLL_S
    tpu_program: dict | None = None  # the TPU check's report (``pipeline.cloud.program_check``); None: skipped
    cap_hosts: int | None = None  # hosts the plan caps an auto per-device batch for (``plan.Plan``)

    @property
    def out(self) -> str:
        return self.settings.out
