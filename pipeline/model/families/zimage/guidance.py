"""Z-Image's guidance rule, "zimage", as ``ZImagePipeline`` runs it: an image whose guidance
g is above 0 takes ``cond + g * (cond - uncond)`` (g = 1 already guides); at 0 (or below)
the conditional prediction alone, selected. Registered with the family (``ZImage.rules``)."""
from __future__ import annotations

import dataclasses

from pipeline.model.sampling.guidance import Rule


@dataclasses.dataclass(frozen=True)
class ZImageRule(Rule):
    def combine(self, prediction, scale):
        import jax.numpy as jnp

        uncond, cond = jnp.split(prediction, 2)
        return jnp.where(scale > self.above, cond + scale * (cond - uncond), cond)


ZIMAGE = ZImageRule("zimage", "Z-Image's classifier-free guidance, as ZImagePipeline runs it: an image whose guidance "
                              "g is above 0 takes prompt + g x (prompt - negative prompt); at 0, the prompt alone (the "
                              "Turbo recipe). Not SD's scale: g = 1 already guides", above=0.0)
