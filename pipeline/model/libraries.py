"""The model libraries, diffusers and transformers, set up the way promptmill uses them."""
from __future__ import annotations


def quiet_libraries() -> None:
    """Silence the libraries' per-instance Flax deprecation warnings.

    We pin diffusers 0.39 and transformers 4.x on purpose (their last releases with
    Flax); the warning repeats for every scheduler and model object and buries our logs.
    """
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
