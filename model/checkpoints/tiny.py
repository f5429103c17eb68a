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
Gemma's own scales (its embedding times sqrt(hidden), its norms by 1 + w) are undone in the
draws (`Tiny.gemma_scales`), so its checkpoints compute at the same scales.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np

from ringserve.model.config import ModelConfig
from ringserve.model.families import FAMILIES, Family
from ringserve.model.paths import atomic_dir, cache_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_DIMS = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=640,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
)
# a family's own fields (`Family.tiny`) a caller may set too: a mixture of experts' sizes, head_dim;
# each only where the family has it (flags default to the family's value)
FAMILY_DIMS = ("head_dim", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size")  # fmt: skip


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


def _hf_config(fam: Family, dims: dict, seed: int) -> dict:
    """config.json of the family's tiny checkpoint, written through transformers' config class (so
    HF loads it): the shared dimensions, the family's own fields (model/families/: `Family.tiny`)."""
    from ringserve.model.checkpoints.tokenizer import quiet_transformers

    quiet_transformers()
    import transformers

    cls = getattr(transformers, fam.tiny.config_class)
    fields: dict = dict(bos_token_id=None, eos_token_id=2, pad_token_id=0) | fam.tiny.fields | dims
    cfg = cls(**fields, rms_norm_eps=1e-5)
    d = cfg.to_dict()
    d["architectures"] = [fam.architectures[0]]
    d["dtype"] = "float32"
    d["ringserve_tiny_seed"] = seed
    return d


def _weights(fam: Family, cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded weights for every tensor of the family's layout, drawn in its order (the module
    docstring says why these scales)."""
    rng = np.random.default_rng(seed)

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> np.ndarray:
        return (gain * rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tied = cfg.tie_word_embeddings
    w = {}
    for name, place in fam.layout(cfg).items():
        shape, module = place.hf_shape, place.path[-2]
        if name == "model.embed_tokens.weight":
            w[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "lm_head.weight":
            w[name] = rng.standard_normal(shape).astype(np.float32)
        elif name == "model.norm.weight":
            w[name] = (norm(shape[0]) * (10.0 if tied else 1.0)).astype(np.float32)
        elif place.path[-1] == "bias":
            w[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif place.transpose:  # a projection; a residual branch's output 3x (the docstring)
            w[name] = lin(shape[0], shape[1], gain=3.0 if module in RESIDUAL_OUT else 1.0)
        else:  # a norm's weight
            w[name] = norm(shape[0])
        if fam.tiny.gemma_scales:  # the model scales them: drawn so that it gets the scales above
            w[name] = _undo_gemma_scales(name, w[name], cfg)
    return w


def _undo_gemma_scales(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Gemma multiplies its embedding by sqrt(hidden) and scales by (1 + w) in its norms: the
    embedding is drawn sqrt(hidden) smaller (the residual stream starts as the others'), the
    tied head's final norm sqrt(hidden) larger (so are the logits), each norm 1 lower."""
    root = np.float32(np.sqrt(cfg.hidden_size))
    if name == "model.embed_tokens.weight":
        return w / root
    if name == "model.norm.weight" and cfg.tie_word_embeddings:
        w = w * root
    return w - np.float32(1.0) if name.endswith("norm.weight") else w


# the projections that write a residual branch's output (their init 3x: the module docstring)
RESIDUAL_OUT = ("o_proj", "down_proj")


def make_tiny_model(out_dir: str | Path, family: str = "llama", seed: int = 0, **dims) -> Path:
    """Write a tiny random checkpoint of `family` into `out_dir` (atomically) and return it.
    `dims`: DEFAULT_DIMS's sizes, and of FAMILY_DIMS those the family has (they replace its own)."""
    from safetensors.numpy import save_file

    if family not in FAMILIES:
        raise ValueError(f"--arch {family!r} is not supported; choose one of {list(FAMILIES)}")
    fam = FAMILIES[family]
    foreign = [k for k in dims if k not in DEFAULT_DIMS and not (k in FAMILY_DIMS and k in fam.tiny.fields)]
    if foreign:
        raise ValueError(f"--arch {family} has no {', '.join(foreign)}: its sizes are {list(DEFAULT_DIMS)} "
                         f"and {[k for k in FAMILY_DIMS if k in fam.tiny.fields]}")  # fmt: skip
    out = Path(out_dir)
    merged = {**DEFAULT_DIMS, **dims}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(_trained_tokenizer_json(merged["vocab_size"]))
    merged["vocab_size"] = tok.get_vocab_size()
    cfg = _hf_config(fam, merged, seed)
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        weights = _weights(fam, fam.config(cfg), seed)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
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
    ap.add_argument("--arch", default="llama", choices=list(FAMILIES))
    ap.add_argument("--seed", type=int, default=0)
    for k, v in DEFAULT_DIMS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    for k in FAMILY_DIMS:
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help="default: the family's own")
    args = ap.parse_args(argv)
    dims = {k: getattr(args, k) for k in DEFAULT_DIMS}
    dims |= {k: getattr(args, k) for k in FAMILY_DIMS if getattr(args, k) is not None}
    print(make_tiny_model(args.out_dir, args.arch, args.seed, **dims))
    return 0
