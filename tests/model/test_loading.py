"""Checkpoint loading: dtypes, config spellings, and clear errors for bad model directories."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest

from ringserve.model.checkpoints.load import load_checkpoint
from ringserve.model.families import parse_config
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.hf_ref import hf_greedy
from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix

CFG = ExecutorConfig(
    page_size=16, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=128, precompile=False
)


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load_and_match_hf(tiny_dir, tmp_path, dtype):
    """A checkpoint saved by transformers in bf16/f16; computed in f32 on both sides."""
    import torch

    from tests.hf_ref import hf_model

    hf = hf_model(str(tiny_dir("qwen2")))  # shared (cached): a copy goes to half precision, not it
    out = tmp_path / dtype
    copy.deepcopy(hf).to(getattr(torch, dtype)).save_pretrained(out)
    config, tensors = load_checkpoint(out)
    assert str(tensors["model.embed_tokens.weight"].dtype) == dtype
    assert config.family == "qwen2" and config.attention_bias
    prompts = prompts_with_shared_prefix(16, [5, 30])
    ours = greedy_with_cached_prefix(ModelExecutor(out, CFG), prompts, 16, 12)
    assert ours == hf_greedy(out, prompts, 12)


def test_rope_theta_and_rope_parameters_spellings_agree(tiny_dir):
    d = json.loads((tiny_dir("llama") / "config.json").read_text())
    new = parse_config(d)
    old = dict(d)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = params
    assert parse_config(old) == new
    assert new.rope.rope_type == "llama3" and new.rope.theta == 500000.0 and new.rope.factor == 8.0
    assert new.tie_word_embeddings


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match=r"model directory .*nope.* does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match=r"config.json: missing"):
        load_checkpoint(tmp_path)


def test_malformed_config(tiny_dir, tmp_path):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: malformed JSON"):
        load_checkpoint(d)


def test_unknown_architecture(tiny_dir, tmp_path):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"config.json: unsupported architecture \['GPT2LMHeadModel'\]; supported"
    ):
        load_checkpoint(d)


def test_missing_required_field(tiny_dir, tmp_path):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: missing required field 'hidden_size'"):
        load_checkpoint(d)


def test_no_weights(tiny_dir, tmp_path):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors weight files"):
        load_checkpoint(d)


def test_truncated_weights(tiny_dir, tmp_path):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100_000])
    with pytest.raises(ValueError, match=r"model.safetensors: tensor .* past the end of the file"):
        load_checkpoint(d)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    from safetensors.numpy import save_file

    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    _, tensors = load_checkpoint(d)
    tensors = {k: np.array(v) for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing 1 tensor\(s\), e.g. \['model.layers.1.mlp.up_proj.weight'\]"
    ):
        ModelExecutor(d, CFG)


def test_wrong_tensor_shape_is_named(tiny_dir, tmp_path):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 512
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(640, 256\), but config.json implies \(512, 256\)",
    ):
        ModelExecutor(d, CFG)


def test_bad_runtime_options(tiny_dir):
    with pytest.raises(ValueError, match="tp_size=3 but 1 cpu device"):
        ModelExecutor(tiny_dir("llama"), ExecutorConfig(tp_size=3, precompile=False))
    with pytest.raises(ValueError, match="dtype='int8'"):
        ModelExecutor(tiny_dir("llama"), ExecutorConfig(dtype="int8", precompile=False))
    with pytest.raises(ValueError, match="attention_backend='pallas' needs a TPU"):
        ModelExecutor(tiny_dir("llama"), ExecutorConfig(attention_backend="pallas", precompile=False))


def test_model_path_is_a_plain_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0")
    with pytest.raises(
        ValueError, match=r"model path .*model\.bin.* is not a directory \(or a \.gguf file\)"
    ):
        load_checkpoint(f)


def test_config_that_is_not_an_object(tiny_dir, tmp_path):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json: expected a JSON object, got list"):
        load_checkpoint(d)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            r"unsupported rope type 'yarn'",
        ),
        ({"num_key_value_heads": 3}, r"num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ],
)
def test_unsupported_config_values(tiny_dir, tmp_path, change, error):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: " + error):
        load_checkpoint(d)


def test_malformed_safetensors_header(tiny_dir, tmp_path):
    d = copy_model(tiny_dir("llama"), tmp_path / "m")
    (d / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b"{not json!!}")
    with pytest.raises(ValueError, match=r"model.safetensors: malformed safetensors header"):
        load_checkpoint(d)


_TOKENIZE = """
import json, sys
if sys.argv[1] == "hide":
    from ringserve.actors.transport.actor import without_torch
    without_torch()
from ringserve.model.checkpoints.tokenizer import load_tokenizer
out = {}
for d in sys.argv[2:]:
    t = load_tokenizer(d)
    s = "Hello world, <|im_start|> \\u00fcn\\u00efcode 123  spaces\\n\\n x"
    ids = t(s)["input_ids"]
    chat = t.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    out[d] = [type(t).__name__, ids, t.decode(ids), t.all_special_ids, t.eos_token_id, chat]
print(json.dumps([out, sys.modules.get("torch") is not None]))
"""


def test_tokenizers_load_the_same_without_torch(tiny_dir):
    """Actors and `ringserve serve` hide torch so transformers does not import it (~2.5 s and
    ~250 MB a process); each family's tokenizer must load as the same class and tokenize the
    same way as with torch importable."""
    import subprocess
    import sys

    pytest.importorskip("torch")
    dirs = [str(tiny_dir(f)) for f in ("llama", "qwen2", "qwen3", "mistral")]
    runs = {}
    for mode in ("show", "hide"):
        argv = [sys.executable, "-c", _TOKENIZE, mode, *dirs]
        p = subprocess.run(argv, capture_output=True, text=True, check=True)
        runs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    assert runs["hide"][0] == runs["show"][0]
    assert runs["show"][1] and not runs["hide"][1]  # torch imported only where it was not hidden


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_release_pages_drops_checkpoint_pages_and_keeps_values(tmp_path):
    """After the served state is built the executor releases the checkpoint's mapped pages: RSS
    falls by the file's size and the tensors read back unchanged (from the page cache)."""
    from safetensors.numpy import save_file

    from ringserve.model.checkpoints.load import read_safetensors, release_pages

    rng = np.random.default_rng(0)
    want = {f"w{i}": rng.standard_normal((1024, 2048), np.float32) for i in range(8)}  # 64 MiB
    save_file(want, str(tmp_path / "m.safetensors"))
    got = dict(read_safetensors(tmp_path / "m.safetensors"))
    sums = {k: float(v.sum()) for k, v in got.items()}  # reads every page
    before = _rss_file_kb()
    assert release_pages(got) >= 64 * 2**20
    after = _rss_file_kb()
    assert before - after > 48 * 1024, (before, after)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)
        assert float(got[k].sum()) == sums[k]
    assert release_pages({"plain": np.zeros(4)}) == 0  # arrays not mapped from a file are left alone
