"""What the TPU check raises: it could not run, or the program does not fit."""
from __future__ import annotations


class TpuCheckError(RuntimeError):
    """The check could not run (no libtpu, a topology libtpu does not know)."""


class DoesNotFit(ValueError):
    """The run's program does not fit the target chip; the message has the figures."""
