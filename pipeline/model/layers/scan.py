"""Stacks of identical blocks as one ``nn.scan`` over weights stacked on a leading layer axis."""
from __future__ import annotations

import flax.linen as nn


def stacked(block, length: int, broadcasts: int, unroll: int = 1):
    """``block`` scanned ``length`` times: the carry threads through, its other
    ``broadcasts`` inputs are the same for every layer; ``unroll`` layers per loop step."""
    return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                   in_axes=(nn.broadcast,) * broadcasts, length=length, unroll=unroll)
