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


def import_libraries() -> None:
    """``quiet_libraries``, and the Flax classes promptmill loads, imported on this thread.

    Call it before two threads may import them at once (a host loads its weights on one
    while its sampler is made on another): Python can hand the second thread a
    half-initialised package ("cannot import name ... from partially initialized module")."""
    quiet_libraries()
    from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel  # noqa: F401
    from transformers import CLIPTokenizer, FlaxCLIPTextModel, FlaxCLIPTextModelWithProjection  # noqa: F401
