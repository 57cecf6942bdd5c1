"""A network's parameter shapes are traced once per machine (diffusers networks and
transformers models), and are the traced ones."""
import json
import os
import threading

import jax
import jax.numpy as jnp
import pytest

from pipeline.model import load as model_lib
from pipeline.model.loading import shapes


@pytest.fixture
def fresh(tmp_path, monkeypatch, model_cache):
    """An empty shapes folder and process memo (the suite's models kept); the names of the
    network classes traced, in order."""
    model_lib.resolve("tiny")
    model_lib.resolve("tiny-sdxl")
    (tmp_path / "cache").mkdir()
    os.symlink(os.path.join(model_cache, "models"), tmp_path / "cache" / "models")
    monkeypatch.setenv("PROMPTMILL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(shapes, "_shapes", {})
    monkeypatch.setattr(shapes, "_models", {})
    traced = []
    real = shapes._trace
    monkeypatch.setattr(shapes, "_trace", lambda module: traced.append(type(module).__name__) or real(module))
    return traced


def _networks(name="tiny-sdxl"):
    from diffusers import FlaxAutoencoderKL, FlaxUNet2DConditionModel

    directory = model_lib.resolve(name)
    return [cls.from_config(cls.load_config(os.path.join(directory, component)), dtype=jnp.float32)
            for cls, component in ((FlaxUNet2DConditionModel, "unet"), (FlaxAutoencoderKL, "vae"))]


def _as_pairs(tree):
    return jax.tree_util.tree_map(lambda leaf: (leaf.shape, leaf.dtype), tree)


def test_kept_shapes_are_the_traced_ones_and_a_machine_traces_a_config_once(fresh, model_cache):
    for module in _networks():
        traced = jax.eval_shape(module.init_weights, jax.ShapeDtypeStruct((2,), jnp.uint32))
        first = shapes.diffusers_shapes(module)
        assert jax.tree_util.tree_structure(first) == jax.tree_util.tree_structure(traced)
        assert _as_pairs(first) == _as_pairs(traced)
        shapes._shapes.clear()  # another process on the same machine: read from the cache folder
        again = shapes.diffusers_shapes(module)
        assert _as_pairs(again) == _as_pairs(traced)
        again["extra"] = None  # each caller gets its own tree
        assert "extra" not in shapes.diffusers_shapes(module)
    assert fresh == ["FlaxUNet2DConditionModel", "FlaxAutoencoderKL"]
    assert len(os.listdir(os.path.join(os.environ["PROMPTMILL_CACHE"], shapes.SHAPES))) == 2


def test_another_config_is_traced_and_unreadable_shapes_are_traced_again(fresh, model_cache):
    unet, _ = _networks("tiny")
    shapes.diffusers_shapes(unet)
    wider = unet.clone(cross_attention_dim=unet.cross_attention_dim * 2)
    assert _as_pairs(shapes.diffusers_shapes(wider)) != _as_pairs(shapes.diffusers_shapes(unet))
    assert fresh == ["FlaxUNet2DConditionModel"] * 2
    folder = os.path.join(os.environ["PROMPTMILL_CACHE"], shapes.SHAPES)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "w") as f:
            f.write('{"truncated": [[1, 2], "float')
    shapes._shapes.clear()
    shapes.diffusers_shapes(unet)
    assert fresh == ["FlaxUNet2DConditionModel"] * 3
    with open(shapes._path(shapes._key(unet))) as f:
        assert "conv_in/kernel" in json.load(f)  # rewritten whole


def test_threads_asking_at_once_share_one_trace(fresh, model_cache):
    unet, _ = _networks("tiny")
    results = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, shapes.diffusers_shapes(unet)))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fresh == ["FlaxUNet2DConditionModel"]
    assert all(_as_pairs(r) == _as_pairs(results[0]) for r in results)


def test_a_transformers_model_without_weights_is_built_once_per_config_and_dtype(fresh, model_cache, monkeypatch):
    from transformers import CLIPTextConfig, FlaxCLIPTextModel

    traced = []
    real = shapes._transformers_trace
    monkeypatch.setattr(shapes, "_transformers_trace", lambda *a: traced.append(a[0].__name__) or real(*a))
    config = CLIPTextConfig.from_pretrained(os.path.join(model_lib.resolve("tiny"), "text_encoder"))
    a = shapes.transformers_model(FlaxCLIPTextModel, config, jnp.float32)
    assert shapes.transformers_model(FlaxCLIPTextModel, CLIPTextConfig.from_dict(config.to_dict()), jnp.float32) is a
    assert shapes.transformers_model(FlaxCLIPTextModel, config, jnp.bfloat16) is not a
    other = CLIPTextConfig.from_dict({**config.to_dict(), "hidden_size": config.hidden_size * 2})
    b = shapes.transformers_model(FlaxCLIPTextModel, other, jnp.float32)
    assert b is not a and a.params_shape_tree != b.params_shape_tree
    assert traced == ["FlaxCLIPTextModel"] * 3
    # another process on the same machine: the shapes from the cache folder, nothing traced
    shapes._models.clear()
    again = shapes.transformers_model(FlaxCLIPTextModel, config, jnp.float32)
    assert traced == ["FlaxCLIPTextModel"] * 3 and again is not a
    assert jax.tree_util.tree_structure(again.params_shape_tree) == jax.tree_util.tree_structure(a.params_shape_tree)
    assert _as_pairs(again.params_shape_tree) == _as_pairs(a.params_shape_tree)
    # a model's abstract and concrete loads (a host's two threads) share it
    abstract = model_lib.load("tiny", abstract=True)
    assert model_lib.load("tiny").nets.text_encoder is abstract.nets.text_encoder


@pytest.mark.parametrize("name", ["FlaxCLIPTextModel", "FlaxCLIPTextModelWithProjection"])
def test_a_transformers_model_is_the_librarys_own_shapes_module_and_call(model_cache, name):
    """Against transformers' model object of the same class, config and dtype: the same
    shapes, the same module and prefix, and the same outputs, hidden states included."""
    import numpy as np
    import transformers
    from transformers import CLIPTextConfig

    cls = getattr(transformers, name)
    directory = os.path.join(model_lib.resolve("tiny-sdxl"),
                             "text_encoder_2" if name.endswith("Projection") else "text_encoder")
    config = CLIPTextConfig.from_pretrained(directory)
    ours, theirs = shapes.transformers_model(cls, config, jnp.float32), cls(config, dtype=jnp.float32, _do_init=False)
    assert _as_pairs(ours.params_shape_tree) == _as_pairs(theirs.params_shape_tree)
    assert ours.module == theirs.module and ours.base_model_prefix == theirs.base_model_prefix
    params = model_lib.load("tiny-sdxl").params["text_encoder_2" if name.endswith("Projection") else "text_encoder"]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 77)), jnp.int32)
    for hidden in (None, True):
        mine, reference = ours(ids, params=params, output_hidden_states=hidden), \
            theirs(ids, params=params, output_hidden_states=hidden)
        assert jax.tree_util.tree_structure(mine) == jax.tree_util.tree_structure(reference)
        for x, y in zip(jax.tree_util.tree_leaves(mine), jax.tree_util.tree_leaves(reference), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
