"""promptmill's tokenizers (``pipeline.model.loading.tokenizer``, on the ``tokenizers`` library)
against the ids transformers 4.57's tokenizer classes gave, stored once by
``tests/fixtures/make_tokenizer_fixtures.sh`` for every string of the suite (its prompts
among them), long and non-ASCII ones included: CLIP's Python tokenizer on the built-in
vocabulary (padded with the end token, and with SDXL's "!"), on a vocabulary with merges,
T5's and Qwen's fast tokenizers, and Qwen's chat template. These tests need no transformers.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeline.model.loading import tokenizer
from tests.conftest import TESTS
from tests.fixtures import make_tokenizer_fixtures as fixtures

FOLDER = os.path.join(TESTS, "fixtures", "tokenizers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tokenizers' files, written by promptmill's own writers (as the fixture script wrote them)."""
    return fixtures.write_folders(str(tmp_path_factory.mktemp("tokenizers")))


@pytest.fixture(scope="module")
def texts():
    with np.load(os.path.join(FOLDER, "texts.npz")) as data:
        return json.loads(str(data["texts"]))


def stored(name):
    with np.load(os.path.join(FOLDER, f"{name}.npz")) as data:
        return {key: data[key] for key in data.files}


def test_the_fixtures_hold_the_suites_prompts_long_and_non_ascii(texts):
    assert "transformers" in json.loads(str(stored("clip")["meta"]))
    assert {"a red cube on a table", "a blue sphere", "a red fox in the snow"} <= set(texts)
    assert any(len(t) > 300 for t in texts) and any("日本語" in t for t in texts)
    assert len(texts) > 4000  # every string constant of the suite when the fixtures were made


def load(name, folders):
    if name.startswith("clip"):
        return tokenizer.clip(folders[name])
    return tokenizer.from_json(folders[name], 512 if name == "t5" else 131072)


@pytest.mark.parametrize("name", ["clip", "clip_bang", "clip_merges", "t5", "qwen"])
def test_token_ids_equal_transformers(folders, texts, name):
    expected = stored(name)
    ours = load(name, folders)
    length = fixtures.LENGTHS[name]
    ids = ours.ids(texts, length)
    wrong = [texts[i] for i in np.nonzero((ids != expected["ids"]).any(axis=1))[0]]
    assert not wrong, f"{len(wrong)} texts tokenise otherwise, e.g. {wrong[:3]!r}"
    np.testing.assert_array_equal(ours.counts(texts), expected["counts"])


def test_the_vocabulary_with_merges_is_the_fixtures(folders):
    expected = stored("clip_merges")
    with open(os.path.join(folders["clip_merges"], "vocab.json"), encoding="utf-8") as f:
        assert json.load(f) == json.loads(str(expected["vocab"]))
    assert list(expected["merges"]) == fixtures.MERGES
    text = ["the cat and the snow photo"]
    assert tokenizer.clip(folders["clip_merges"]).counts(text)[0] == 8  # the merges make words of it
    assert tokenizer.clip(folders["clip"]).counts(text)[0] == 2 + len(text[0].replace(" ", ""))


@pytest.mark.parametrize("thinking", [True, False])
def test_the_chat_template_renders_as_transformers_did(folders, texts, thinking):
    key = "chat_thinking" if thinking else "chat_no_thinking"
    expected = stored("qwen")
    ours = load("qwen", folders)
    rendered = [ours.render_chat([{"role": "user", "content": t}], add_generation_prompt=True,
                                 enable_thinking=thinking) for t in texts]
    assert [rendered[texts.index(t)] for t in fixtures.EXTRA] == json.loads(str(expected[key]))
    np.testing.assert_array_equal(ours.ids(rendered, fixtures.LENGTHS["qwen"]), expected[f"{key}_ids"])
    np.testing.assert_array_equal(ours.counts(rendered), expected[f"{key}_counts"])


def test_clip_text_is_cleaned_as_clips_tokenizer_cleans_it():
    assert tokenizer.clean_clip_text("  A\tB\nC  ") == "a b c"
    assert tokenizer.clean_clip_text("日本") == "日 本"  # ideographs apart
    assert tokenizer.clean_clip_text("ΟΔΟΣ") == "οδος"  # Python's lower: the final sigma
    assert tokenizer.clean_clip_text("e\u0301") == "\u00e9"  # NFC
    assert tokenizer.clean_clip_text("a\x00b\x07c\ufffd") == "abc"
    assert len(tokenizer.byte_symbols()) == len(set(tokenizer.byte_symbols())) == 256


def test_a_tokenizer_folder_missing_a_file_is_named(tmp_path, folders):
    import shutil

    broken = tmp_path / "clip"
    shutil.copytree(folders["clip"], broken)
    os.remove(broken / "merges.txt")
    with pytest.raises(tokenizer.TokenizerError, match="no merges.txt"):
        tokenizer.clip(str(broken))
    with pytest.raises(tokenizer.TokenizerError, match="no tokenizer.json"):
        tokenizer.from_json(str(tmp_path), 512)
