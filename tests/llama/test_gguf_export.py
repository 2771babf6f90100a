"""The GGUF writer's own rules, without llama.cpp: the rotary row order, and what it refuses (by file and field)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from specd.llama.gguf_export import export, pairs_interleaved
from specd_api.errors import UsageError
from tests.llama.conftest import REFERENCE


def test_each_heads_rows_go_from_halves_to_adjacent_pairs():
    heads, d, cols = 3, 4, 2
    weight = np.arange(heads * d * cols, dtype=np.float32).reshape(heads * d, cols)
    out = pairs_interleaved(weight, heads)
    for h in range(heads):
        for i in range(d // 2):
            assert (out[h * d + 2 * i] == weight[h * d + i]).all()
            assert (out[h * d + 2 * i + 1] == weight[h * d + i + d // 2]).all()


@pytest.mark.parametrize(
    ("change", "names"),
    [({"model_type": "gpt2"}, "model_type"), ({"rope_parameters": {"rope_type": "llama3"}}, "rope scaling"),
     ({"attention_bias": True}, "biases")],
)  # fmt: skip
def test_a_model_it_cannot_export_is_refused_naming_the_file_and_field(tmp_path, change, names):
    folder = tmp_path / "model"
    shutil.copytree(REFERENCE / "draft", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UsageError, match=names) as refused:
        export(folder, tmp_path / "out.gguf")
    assert str(folder / "config.json") in str(refused.value)


def test_a_tokenizer_that_is_not_byte_level_bpe_is_refused(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(REFERENCE / "draft", folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UsageError, match="byte-level BPE"):
        export(folder, tmp_path / "out.gguf")


def test_the_command_reports_a_missing_model_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "specd", "export-gguf", "--model", str(tmp_path / "none"),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "config.json" in done.stderr, done.stderr


def gguf_value(path, key: str):
    import gguf

    field = gguf.GGUFReader(path).fields.get(key)
    return None if field is None else field.parts[field.data[0]][0]


def test_the_end_of_text_token_comes_from_the_model_config_without_a_tokenizer_config(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(REFERENCE / "draft", folder)
    (folder / "tokenizer_config.json").unlink()
    out = export(folder, tmp_path / "out.gguf")
    assert gguf_value(out, "tokenizer.ggml.eos_token_id") == 0
    assert not gguf_value(out, "tokenizer.ggml.add_bos_token")
    config = json.loads((folder / "config.json").read_text())
    del config["eos_token_id"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="end-of-text"):
        export(folder, tmp_path / "out.gguf")


def test_an_untied_model_without_its_output_projection_is_refused(tmp_path):
    """The shipped draft ties its output projection to the embedding (no lm_head weight): said untied, it is
    refused by name, not exported with the embedding in its place."""
    folder = tmp_path / "model"
    shutil.copytree(REFERENCE / "draft", folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"]
    export(folder, tmp_path / "tied.gguf")
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(UsageError, match="lm_head"):
        export(folder, tmp_path / "out.gguf")
