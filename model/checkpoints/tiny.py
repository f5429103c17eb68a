"""`ringserve make-tiny-model`: a tiny random-weight HF-format checkpoint, made offline.

The directory holds `config.json` (written through transformers' config classes, so HF loads
it), `model.safetensors` (seeded NumPy weights), `tokenizer.json` (a byte-level BPE trained with
`tokenizers` on the Python documentation shipped with every CPython, `pydoc_data.topics`),
`tokenizer_config.json` (ChatML chat template) and `generation_config.json`.
Same arguments and seed -> same bytes.

Greedy decoding on random weights is only well defined when the top two logits are far apart
compared with float32 rounding, and only interesting when the model does not just repeat its
input. The init is scaled for both (measured on 3 prompts x 32 greedy tokens with HF):
- projections have std `1/sqrt(fan_in)`, and `o_proj`/`down_proj` 3x that, so the layers, not
  the token embedding, dominate the residual stream (with std-1 tied embeddings the model only
  ever repeats its last input token);
- embeddings have std 0.1; an untied LM head has std 1; a tied one reuses the embedding, so
  the final norm weight is scaled by 10 instead. Either way logits have std ~sqrt(hidden) = 16,
  and the median top-2 gap is ~3-4 with the smallest ~0.1 over those 96 steps: four orders of
  magnitude above the ~1e-5 float32 difference between two implementations.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np
from ringserve.model.paths import atomic_dir, cache_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
DEFAULT_DIMS = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=640,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
)


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    return train_tokenizer(vocab_size).to_str()


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on `pydoc_data.topics` (CPython's own docs: offline, deterministic)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [topics[k] for k in sorted(topics)]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _hf_config(family: str, dims: dict, seed: int) -> dict:
    from ringserve.model.checkpoints.tokenizer import quiet_transformers

    quiet_transformers()
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[family]
    extra: dict = dict(bos_token_id=None, eos_token_id=2, pad_token_id=0)
    if family == "llama":  # exercises llama3 RoPE scaling and tied embeddings
        extra.update(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        )
    elif family == "qwen3":  # head_dim decoupled from hidden/heads, as in real Qwen3
        extra.update(tie_word_embeddings=False, head_dim=48, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif family == "qwen2":
        extra.update(tie_word_embeddings=False, use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    else:  # mistral: no sliding window here (v0.2+ style), so full attention
        extra.update(tie_word_embeddings=False, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = cls(**dims, rms_norm_eps=1e-5, **extra)
    d = cfg.to_dict()
    d["architectures"] = [cls.__name__.replace("Config", "ForCausalLM")]
    d["dtype"] = "float32"
    d["ringserve_tiny_seed"] = seed
    return d


def _weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    family = cfg["model_type"]

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> np.ndarray:
        return (gain * rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tied = bool(cfg.get("tie_word_embeddings"))
    w = {"model.embed_tokens.weight": (0.1 * rng.standard_normal((v, h))).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = lin(heads * hd, h)
        w[p + "self_attn.k_proj.weight"] = lin(kv * hd, h)
        w[p + "self_attn.v_proj.weight"] = lin(kv * hd, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, heads * hd, gain=3.0)
        if family == "qwen2":
            for n, size in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
                w[p + f"self_attn.{n}_proj.bias"] = (0.1 * rng.standard_normal(size)).astype(np.float32)
        if family == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = lin(inter, h)
        w[p + "mlp.up_proj.weight"] = lin(inter, h)
        w[p + "mlp.down_proj.weight"] = lin(h, inter, gain=3.0)
    w["model.norm.weight"] = (norm(h) * (10.0 if tied else 1.0)).astype(np.float32)
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((v, h)).astype(np.float32)
    return w


def make_tiny_model(out_dir: str | Path, family: str = "llama", seed: int = 0, **dims) -> Path:
    """Write a tiny random checkpoint of `family` into `out_dir` (atomically) and return it."""
    from safetensors.numpy import save_file

    if family not in FAMILIES:
        raise ValueError(f"--arch {family!r} is not supported; choose one of {list(FAMILIES)}")
    out = Path(out_dir)
    merged = {**DEFAULT_DIMS, **dims}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_trained_tokenizer_json(merged["vocab_size"]))
    merged["vocab_size"] = tok.get_vocab_size()
    cfg = _hf_config(family, merged, seed)
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(_weights(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save(str(tmp / "tokenizer.json"))
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "model_max_length": cfg["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
        gen = {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"], "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    return out


def tiny_model_path(family: str = "llama", seed: int = 0) -> Path:
    """The cached tiny model of `family`, made on first use (the embedded default model)."""
    path = cache_dir("models", f"tiny-{family}-s{seed}")
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, family, seed)
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ringserve make-tiny-model", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", help="directory to write (replaced if it exists)")
    ap.add_argument("--arch", default="llama", choices=FAMILIES)
    ap.add_argument("--seed", type=int, default=0)
    for k, v in DEFAULT_DIMS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    args = ap.parse_args(argv)
    dims = {k: getattr(args, k) for k in DEFAULT_DIMS}
    print(make_tiny_model(args.out_dir, args.arch, args.seed, **dims))
    return 0
