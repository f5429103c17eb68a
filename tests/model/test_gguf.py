"""GGUF loading: tiny checkpoints written as llama.cpp would write them (q/k rows permuted, llama3
RoPE as `rope_freqs` divisors, vocabulary as token lists) load back to the same config, the same
logits and the same tokenizer; bad files fail with errors naming the file and the problem."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from ringserve.model.checkpoints.gguf import (
    gguf_tokenizer_dir,
    load_gguf_tokenizer,
    permute_rope_rows,
    read_gguf_weights,
    unpermute_rope_rows,
)
from ringserve.model.checkpoints.load import load_checkpoint
from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.families import parse_config
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.model.bpe_ref import TEXTS, RefBPE

CFG = ExecutorConfig(
    page_size=16, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=128, precompile=False
)
Q = gguf.GGMLQuantizationType
# HF -> llama.cpp tensor names (gguf-py's tensor map, written out here independently of model/gguf.py)
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output", "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
    "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
}  # fmt: skip
# Gemma's sandwich layer (llama.cpp's gemma2 / gemma3 names)
GEMMA_LAYER = LAYER | {"post_attention_layernorm.weight": "post_attention_norm", "pre_feedforward_layernorm.weight": "ffn_norm",
                       "post_feedforward_layernorm.weight": "post_ffw_norm"}  # fmt: skip
GEMMA = ("gemma2", "gemma3")
# mixtures of experts: llama.cpp's architecture (Mixtral's is llama's, with llama.expert_count), the
# router and Qwen2-MoE's shared expert; each expert's tensors (HF's w1/w3/w2: Mixtral's) stacked
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
MOE_LAYER = {"mlp.gate.weight": "ffn_gate_inp", "block_sparse_moe.gate.weight": "ffn_gate_inp",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
             "mlp.shared_expert.up_proj.weight": "ffn_up_shexp", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp"}  # fmt: skip
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_FFN = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}  # fmt: skip


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, i, rest = hf.split(".", 3)
    name = (GEMMA_LAYER if arch in GEMMA else LAYER | MOE_LAYER)[rest]
    return f"blk.{i}.{name}" + ("" if name.endswith(".bias") else ".weight")


def stack_experts(tensors: dict, per_expert: bool) -> dict:
    """llama.cpp's MoE layout of HF tensors: each layer's experts' gate, up and down projections
    stacked [E, out, in] as `blk.N.ffn_gate_exps.weight` (`per_expert`: older Mixtral files,
    `blk.N.ffn_gate.E.weight` each); every other tensor keeps its HF name."""
    out, stacks = {}, {}
    for name, a in tensors.items():
        if m := EXPERT.fullmatch(name):
            layer, e, proj = m.groups()
            ffn = EXPERT_FFN[proj]
            if per_expert:
                out[f"blk.{layer}.ffn_{ffn}.{e}.weight"] = a
            else:
                stacks.setdefault(f"blk.{layer}.ffn_{ffn}_exps.weight", {})[int(e)] = a
        else:
            out[name] = a
    return out | {k: np.stack([v[e] for e in range(len(v))]) for k, v in stacks.items()}


def llama3_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs for llama3 scaling (Meta's rule)."""
    base = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    old, lo, hi, factor = (
        rope[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "factor")
    )
    out = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, np.float32)


def write_gguf(
    src: Path,
    out: Path,
    *,
    pre: str = "gpt2",
    qtype=None,
    add_bos: bool = False,
    tensor_type=None,
    per_expert: bool = False,
    moe_meta: dict | None = None,
    extra=None,
) -> Path:
    """Write the HF checkpoint `src` as a llama.cpp-style GGUF (F32 unless `qtype` for 2-D and 3-D
    weights, the router aside, as llama.cpp's converter keeps it F32). A mixture of experts'
    experts stacked per layer (`per_expert`: one tensor each, as older Mixtral files); `moe_meta`
    overrides its `{arch}.expert_*` keys (None: left out). `extra(writer)` adds more."""
    cfg = json.loads((src / "config.json").read_text())
    mc = parse_config(cfg)
    _, tensors = load_checkpoint(src)
    arch = GGUF_ARCH.get(mc.family, mc.family)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(mc.num_layers)
    w.add_context_length(mc.max_position_embeddings)
    w.add_embedding_length(mc.hidden_size)
    w.add_feed_forward_length(mc.intermediate_size)
    w.add_head_count(mc.num_heads)
    w.add_head_count_kv(mc.num_kv_heads)
    w.add_key_length(mc.head_dim)
    w.add_value_length(mc.head_dim)
    w.add_rope_dimension_count(mc.head_dim)
    w.add_rope_freq_base(mc.rope.theta)
    w.add_layer_norm_rms_eps(mc.rms_norm_eps)
    w.add_vocab_size(mc.vocab_size)
    if mc.num_experts:  # Mixtral's each expert's size is feed_forward_length (its intermediate_size)
        moe = {"expert_count": mc.num_experts, "expert_used_count": mc.num_experts_per_tok,
               "expert_feed_forward_length": mc.moe_intermediate_size if arch != "llama" else None,
               "expert_shared_feed_forward_length": mc.shared_expert_intermediate_size or None}  # fmt: skip
        for key, v in (moe | (moe_meta or {})).items():
            if v is not None:
                w.add_uint32(f"{arch}.{key}", v)
    if extra is not None:
        extra(w)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    if add_bos:
        w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(json.loads((src / "tokenizer_config.json").read_text())["chat_template"])
    if arch in GEMMA:  # llama.cpp's Gemma converter: the window, the caps, the global RoPE's scaling
        w.add_sliding_window(mc.sliding_window)
        if mc.attn_logit_softcap:
            w.add_attn_logit_softcapping(mc.attn_logit_softcap)
        if mc.final_logit_softcap:
            w.add_final_logit_softcapping(mc.final_logit_softcap)
        if mc.rope.rope_type == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(mc.rope.factor)
        if arch == "gemma3" and mc.sliding_layers is not None:  # (else llama.cpp's fixed pattern)
            w.add_sliding_window_pattern(list(mc.sliding_layers))
    if mc.rope.rope_type == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_divisors(cfg["rope_parameters"], mc.head_dim))
    for hf, a in stack_experts(tensors, per_expert).items():
        a = np.asarray(a, np.float32)
        if arch == "llama" and ".q_proj." in hf:
            a = permute_rope_rows(a, mc.num_heads)
        elif arch == "llama" and ".k_proj." in hf:
            a = permute_rope_rows(a, mc.num_kv_heads)
        elif arch in GEMMA and hf.endswith("norm.weight"):
            a = a + np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
        name = hf if hf.startswith("blk.") else gguf_name(hf, arch)
        if tensor_type is not None and a.ndim == 2:  # raw bytes of that type (content irrelevant)
            block, size = gguf.GGML_QUANT_SIZES[tensor_type]
            raw = np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=tensor_type)
        elif qtype is not None and a.ndim >= 2 and ".ffn_gate_inp." not in name:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def first_logits(path, prompt: list[int]) -> np.ndarray:
    ex = ModelExecutor(path, CFG)
    logits, _ = ex.logits([DeviceRow(np.array(prompt, np.int32), 0, np.arange(1, 5, dtype=np.int32))])
    return logits[0]


def test_permutation_is_llama_cpps_and_inverts():
    """Per head, HF row h*d/2 + j (h = half) sits at GGUF row 2j + h."""
    heads, d = 3, 8
    w = np.arange(heads * d * 2, dtype=np.float32).reshape(heads * d, 2)
    p = permute_rope_rows(w, heads)
    for head in range(heads):
        for j in range(d // 2):
            for h in range(2):
                np.testing.assert_array_equal(p[head * d + 2 * j + h], w[head * d + h * d // 2 + j])
    np.testing.assert_array_equal(unpermute_rope_rows(p, heads), w)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_gives_the_same_config_and_logits_as_the_directory(tiny_dir, tmp_path, family):
    """llama: permuted q/k (3 query heads per kv head), llama3 rope_freqs, tied head;
    qwen2: q/k/v biases, untied head; qwen3: q/k norms, head_dim != hidden/heads."""
    src = tiny_dir(family)
    path = write_gguf(src, tmp_path / f"{family}.gguf")
    config, tensors = load_checkpoint(path)
    ref_config, ref_tensors = load_checkpoint(src)
    assert config == ref_config
    assert sorted(tensors) == sorted(ref_tensors)
    for k in ref_tensors:
        np.testing.assert_array_equal(tensors[k], ref_tensors[k], err_msg=k)
    prompt = np.random.default_rng(3).integers(3, 2000, 40).tolist()
    np.testing.assert_array_equal(first_logits(path, prompt), first_logits(src, prompt))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma3"])
def test_a_ggufs_footprint_is_its_directorys(tiny_dir, tmp_path, family):
    """What the KV pool is sized from (model/checkpoints/footprint.py), read from metadata and
    tensor shapes only: the same as the directory's (llama: rope_freqs is no weight), Gemma's
    sliding layers and window included (the local page space's share)."""
    from ringserve.model.checkpoints.footprint import read_footprint

    src = tiny_dir(family)
    fp = read_footprint(write_gguf(src, tmp_path / f"{family}.gguf"))
    assert fp == read_footprint(src)
    assert fp.num_params == sum(a.size for a in load_checkpoint(src)[1].values())
    assert (fp.sliding_layers, fp.sliding_window) == {"gemma2": (2, 24), "gemma3": (3, 24)}.get(family, (0, 0))
    assert fp.kv_bytes_per_token("float32", layers=1) * fp.num_layers == fp.kv_bytes_per_token("float32")


def test_permuted_rows_are_not_a_no_op(tiny_dir, tmp_path):
    """The file really holds permuted rows, so equal logits above prove the un-permutation."""
    src = tiny_dir("llama")
    raw = gguf.GGUFReader(str(write_gguf(src, tmp_path / "l.gguf")))
    q = next(t for t in raw.tensors if t.name == "blk.0.attn_q.weight")
    _, ref = load_checkpoint(src)
    stored = np.asarray(q.data).reshape(ref["model.layers.0.self_attn.q_proj.weight"].shape)
    assert not np.array_equal(stored, ref["model.layers.0.self_attn.q_proj.weight"])


def test_q4_1_weights_dequantize_to_the_q4_1_formula(tiny_dir, tmp_path):
    """Q4_1 block of 32: f16 scale d, f16 min m, 16 bytes; low nibbles are elements 0..15, high
    nibbles 16..31; x = d * q + m. Decoded here by hand and compared with the loader."""
    path = write_gguf(tiny_dir("qwen2"), tmp_path / "q.gguf", qtype=Q.Q4_1)
    raw = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    _, tensors = read_gguf_weights(path)
    _, ref = load_checkpoint(tiny_dir("qwen2"))
    for hf in ("model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"):
        blocks = np.asarray(raw[gguf_name(hf)].data).reshape(-1, 20)
        d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        by_hand = (d * q + m).reshape(tensors[hf].shape)
        np.testing.assert_allclose(tensors[hf], by_hand, rtol=1e-6, atol=1e-7)
        err = np.abs(tensors[hf] - ref[hf]).max()
        assert 0 < err <= np.abs(ref[hf]).max() / 15 * 1.1  # quantized: close to, not equal to, f32
    config, _ = load_checkpoint(path)
    assert config.family == "qwen2"


def test_unsupported_quantization_names_file_and_type(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir("qwen2"), tmp_path / "iq.gguf", tensor_type=Q.IQ2_XXS)
    with pytest.raises(
        ValueError,
        match=r"iq\.gguf: tensor '[a-z0-9_.]+' is quantized as IQ2_XXS, which ringserve cannot dequantize",
    ):
        load_checkpoint(path)


def test_missing_and_malformed_gguf_files(tmp_path):
    with pytest.raises(ValueError, match=r"GGUF file .*nope\.gguf.* does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(ValueError, match=r"bad\.gguf: not a readable GGUF file"):
        load_checkpoint(bad)


def test_unsupported_architecture_and_pre_tokenizer(tiny_dir, tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ValueError,
        match=r"phi\.gguf: unsupported GGUF architecture 'phi3'; supported: \['gemma2', 'gemma3', 'llama', 'qwen2', 'qwen2moe', 'qwen3', 'qwen3moe'\]",
    ):
        load_checkpoint(tmp_path / "phi.gguf")
    path = write_gguf(tiny_dir("qwen2"), tmp_path / "t.gguf", pre="tekken")
    with pytest.raises(ValueError, match=r"t\.gguf: GGUF pre-tokenizer 'tekken' is not supported"):
        load_gguf_tokenizer(path)


def test_rebuilt_tokenizer_equals_the_original(tiny_dir, tmp_path):
    """The tiny model's own tokenizer.json (GPT-2 pre-tokenizer) against its GGUF rebuild.

    (`tokenizers` reads the original: transformers 5's AutoTokenizer would pick Qwen2Tokenizer
    for a qwen2 directory and swap in its own pre-tokenizer, so the llama directory is used.)"""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    src = tiny_dir("llama")
    original = AutoTokenizer.from_pretrained(str(src))
    raw = Tokenizer.from_file(str(src / "tokenizer.json"))
    rebuilt = load_gguf_tokenizer(write_gguf(src, tmp_path / "t.gguf"))
    for text in TEXTS:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert original.encode(text, add_special_tokens=False) == ids, text
        assert rebuilt.encode(text, add_special_tokens=False) == ids, text
        assert rebuilt.decode(ids) == text
    chat = [{"role": "user", "content": "Hi there"}]
    assert rebuilt.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    ) == original.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert (rebuilt.eos_token, rebuilt.pad_token, rebuilt.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_pre_tokenizers_split_like_llama_cpp(tiny_dir, tmp_path, pre):
    """Each supported pre-tokenizer name against the independent reference (tests/model/bpe_ref.py)."""
    path = write_gguf(tiny_dir("qwen2"), tmp_path / "t.gguf", pre=pre)
    rebuilt = load_gguf_tokenizer(path)
    raw = gguf.GGUFReader(str(path)).fields
    tokens = raw["tokenizer.ggml.tokens"].contents()
    types = raw["tokenizer.ggml.token_type"].contents()
    ref = RefBPE(
        tokens,
        raw["tokenizer.ggml.merges"].contents(),
        pre,
        [t for t, ty in zip(tokens, types, strict=True) if ty == 3],
    )
    for text in TEXTS:
        assert rebuilt.encode(text, add_special_tokens=False) == ref.encode(text), text
    if pre in ("smollm", "qwen2"):  # every digit its own word
        assert [rebuilt.decode([i]) for i in rebuilt.encode("x 2024", add_special_tokens=False)][-4:] == [
            "2",
            "0",
            "2",
            "4",
        ]


def test_add_bos_token_adds_exactly_one(tiny_dir, tmp_path):
    rebuilt = load_gguf_tokenizer(write_gguf(tiny_dir("qwen2"), tmp_path / "b.gguf", add_bos=True))
    bos = rebuilt.convert_tokens_to_ids("<|im_start|>")
    ids = rebuilt.encode("hello")
    assert ids[0] == bos and ids.count(bos) == 1
    assert rebuilt.encode("hello", add_special_tokens=False) == ids[1:]


def test_tokenizer_directory_for_a_gguf(tiny_dir, tmp_path, monkeypatch):
    """What the actors load by path for `--model FILE.gguf`: cached under RINGSERVE_CACHE by content."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_dir("llama"), tmp_path / "t.gguf")
    d = gguf_tokenizer_dir(path)
    assert d.parent == tmp_path / "cache" / "gguf-tokenizers"
    assert sorted(p.name for p in d.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert gguf_tokenizer_dir(path) == d and len(list(d.parent.iterdir())) == 1
    from_dir, in_memory = AutoTokenizer.from_pretrained(str(d)), load_gguf_tokenizer(path)
    for text in TEXTS:
        assert from_dir.encode(text) == in_memory.encode(text), text
    chat = [{"role": "user", "content": "Hi"}]
    assert from_dir.apply_chat_template(chat, tokenize=False) == in_memory.apply_chat_template(
        chat, tokenize=False
    )
