"""GGUF files (llama.cpp's format) of the families it writes (model/families/: `Family.gguf`),
read into HF names, layouts, config and tokenizer.

What a GGUF does differently from an HF checkpoint, and how it is undone here:
- tensors are quantized per block (Q4_1, Q8_0, K-quants, ...): dequantized to float32 with the
  `gguf` package (NumPy only). Types outside `SUPPORTED` are refused, naming file and type;
- GGUF dims are listed fastest-first (`t.shape` = [in, out]); HF `[out, in]` is the reverse;
- for a family whose `gguf.permuted_qk` is set (Llama), llama.cpp's converter permutes the rows
  of q_proj and k_proj so each head's rotary pairs are adjacent rows (2j, 2j+1) instead of HF's halves
  (j, j + d/2). Per head (q: n_head heads, k: n_head_kv heads), with rows viewed as [2, d/2]:
      GGUF rows = HF rows.reshape(2, d/2).T.flatten()  -> HF row h*d/2 + j is GGUF row 2j + h
  `unpermute_rope_rows` inverts it. qwen2/qwen3 files are not permuted (NeoX-style RoPE);
- config comes from metadata (`llama.embedding_length`, ...); llama3 RoPE scaling is stored
  only as a `rope_freqs` tensor of per-frequency divisors, from which the llama3 parameters are
  recovered (and checked to reproduce every frequency) or the file is refused
  (model/checkpoints/gguf_rope.py);
- no output.weight means the LM head is tied to token_embd;
- Gemma's norms (weight w, scaled by 1 + w) are stored as 1 + w (`GGUFNames.norms_plus_one`),
  and its window, layer pattern, soft caps and query scale come from metadata and llama.cpp's
  own rules (model/families/gemma.py);
- a mixture of experts (qwen3moe, qwen2moe, and Mixtral as `llama` with `llama.expert_count`;
  model/families/base.py `GGUFMoe`) stacks each layer's experts in one tensor [E, out, in]
  (`blk.N.ffn_gate_exps.weight`, ...), split here into HF's per-expert tensors (views, no copy;
  quantized blocks run along `in`, so each expert dequantizes from its own rows); older Mixtral
  files hold one tensor per expert (`blk.N.ffn_gate.E.weight`). The counts and sizes come from
  metadata, and top-k renormalization from llama.cpp's fixed rule per architecture. Refused,
  naming file and key or tensor: dense layers among the sparse ones (`leading_dense_block_count`,
  or a layer's `ffn_up.weight`), a router weight scale other than 1 (`expert_weights_scale`).

`load_checkpoint(path.gguf)` converts in memory on each load (weights never touch disk): the
user's file stays the single source, and a dequantized f32 cache would be ~5x its size.
`gguf_to_hf_dir` writes the same conversion as an HF directory (what fetch-model ships).
The tokenizer, which actors load by directory, is written (small) by `gguf_tokenizer_dir`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from ringserve.model.checkpoints.gguf_rope import rope_parameters
from ringserve.model.checkpoints.gguf_tokenizer import MODELS, GGUFVocab, build_tokenizer, hf_tokenizer
from ringserve.model.families import FAMILIES, Family, gguf_family, parse_config
from ringserve.model.families.base import GGUF_TOP, GGUFMoe

SUPPORTED = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_ROPE_FREQS = "rope_freqs.weight"


@dataclasses.dataclass(slots=True)
class GGUFModel:
    config: dict[str, Any]  # an HF config.json
    tensors: dict[str, np.ndarray]  # HF names and layouts, float32
    tokenizer_json: str
    tokenizer_config: dict[str, Any]


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation (adjacent rotary pairs -> HF halves)."""
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, d_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (HF halves -> adjacent rotary pairs); used to write GGUF files."""
    d_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d_half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Meta:
    """Typed access to one GGUF's key/value metadata; errors name the file and the key."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def need(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise ValueError(f"{self.path}: missing GGUF metadata {key!r}")
        return v


def _open(path: Path) -> _Meta:
    import gguf

    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises ValueError/struct.error/... on a bad file
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    return _Meta(reader, path)


def read_gguf_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(HF config dict, HF-named float32 tensors) of a GGUF file."""
    return _weights(_open(Path(path)))


def _family(meta: _Meta) -> tuple[str, Family]:
    """llama.cpp's architecture name of the file and the family that serves it (a `llama` file
    with experts is Mixtral's)."""
    arch = meta.get("general.architecture")
    fam = gguf_family(str(arch), moe=bool(meta.get(f"{arch}.expert_count")))
    if fam is None:
        known = sorted({f.gguf.arch for f in FAMILIES.values() if f.gguf})
        raise ValueError(f"{meta.path}: unsupported GGUF architecture {arch!r}; supported: {known}")
    return str(arch), fam


def _weights(meta: _Meta) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    import gguf

    reader, path = meta.reader, meta.path
    arch, fam = _family(meta)
    assert fam.gguf is not None
    heads = int(meta.need(f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    hidden = int(meta.need(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rot_dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    if rot_dim != head_dim:
        raise ValueError(
            f"{path}: partial RoPE ({arch}.rope.dimension_count={rot_dim} != head_dim={head_dim}) is not supported"
        )
    moe = fam.gguf.moe
    for t in reader.tensors:  # refuse before spending time dequantizing anything
        if moe is not None and (dense := re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight", t.name)):
            raise ValueError(f"{path}: layer {dense[1]} has a dense MLP ({t.name!r}) where {arch!r} has experts; "
                             f"ringserve serves mixtures of experts whose every layer is sparse")  # fmt: skip
        if t.tensor_type.name not in SUPPORTED:
            raise ValueError(
                f"{path}: tensor {t.name!r} is quantized as {t.tensor_type.name}, which ringserve cannot "
                f"dequantize; supported types: {', '.join(SUPPORTED)}"
            )
    moe_config = _moe_config(meta, arch, moe) if moe is not None else {}
    tensors: dict[str, np.ndarray] = {}
    rope_freqs = None
    for t in reader.tensors:
        a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        a = a.reshape(tuple(int(x) for x in reversed(t.shape)))
        if t.name == _ROPE_FREQS:
            rope_freqs = a
            continue
        named = _hf_name(t.name, fam.gguf.layer)
        if named is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for architecture {arch!r}")
        hf, expert = named
        if "{e}" in hf and expert is None:  # the layer's experts stacked: [E, out, in]
            if a.ndim != 3 or a.shape[0] != meta.get(f"{arch}.expert_count"):
                raise ValueError(f"{path}: tensor {t.name!r} has shape {list(a.shape)}, expected "
                                 f"[{arch}.expert_count, out, in]")  # fmt: skip
            tensors |= {hf.format(e=e): a[e] for e in range(a.shape[0])}
            continue
        hf = hf.format(e=expert) if expert is not None else hf
        if fam.gguf.permuted_qk and ".q_proj." in hf:
            a = unpermute_rope_rows(a, heads)
        elif fam.gguf.permuted_qk and ".k_proj." in hf:
            a = unpermute_rope_rows(a, kv_heads)
        elif fam.gguf.norms_plus_one and hf.endswith("norm.weight"):
            a = a - np.float32(1.0)  # stored as Gemma's (1 + w)
        tensors[hf] = a
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    n_tokens = len(meta.get("tokenizer.ggml.tokens") or [])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    stops = list(
        dict.fromkeys(
            int(i)
            for k in ("eos", "eot", "eom")
            if (i := meta.get(f"tokenizer.ggml.{k}_token_id")) is not None
        )
    )
    config: dict[str, Any] = {
        "architectures": [fam.architectures[0]],
        "model_type": fam.model_types[0],  # HF's (llama.cpp's gemma3 is HF's gemma3_text)
        "vocab_size": int(
            meta.get(f"{arch}.vocab_size") or n_tokens or tensors["model.embed_tokens.weight"].shape[0]
        ),
        "hidden_size": hidden,
        "intermediate_size": int(meta.need(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.need(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # GGUF stores f32: print the shortest decimal that round-trips (1e-05, not 9.99999974e-06)
        "rms_norm_eps": float(str(np.float32(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")))),
        "max_position_embeddings": int(meta.need(f"{arch}.context_length")),
        "rope_parameters": rope_parameters(meta.get, meta.path, arch, head_dim, rope_freqs),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos),
        "dtype": "float32",
    }
    if fam.gguf.read_config is not None:
        config |= fam.gguf.read_config(meta.get, config)
    return config | moe_config | fam.gguf.config, tensors


def _moe_config(meta: _Meta, arch: str, moe: GGUFMoe) -> dict[str, Any]:
    """config.json's MoE fields (the family's names) from a MoE file's metadata, as llama.cpp reads
    it: where a size is left out, its default (feed_forward_length / expert_used_count for each
    expert, feed_forward_length for the shared one). What llama.cpp would compute differently
    from the family is refused, naming the key."""
    dense = meta.get(f"{arch}.leading_dense_block_count")
    if dense:
        raise ValueError(f"{meta.path}: {arch}.leading_dense_block_count={dense}: the first {dense} layers have dense "
                         f"MLPs; ringserve serves mixtures of experts whose every layer is sparse")  # fmt: skip
    scale = meta.get(f"{arch}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):  # llama.cpp scales the routing weights by it (0 and 1: not at all)
        raise ValueError(f"{meta.path}: {arch}.expert_weights_scale={scale:g} is not supported (routing weights "
                         f"scaled; the {arch} models served are unscaled)")  # fmt: skip
    ff, k = int(meta.need(f"{arch}.feed_forward_length")), int(meta.need(f"{arch}.expert_used_count"))
    out: dict[str, Any] = {moe.experts_field: int(meta.need(f"{arch}.expert_count")), "num_experts_per_tok": k}  # fmt: skip
    if moe.expert_size:
        out["moe_intermediate_size"] = int(meta.get(f"{arch}.expert_feed_forward_length") or ff // k)
    if moe.shared:
        shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
        out["shared_expert_intermediate_size"] = int(shared or ff)
    if moe.norm_topk_prob is not None:
        out["norm_topk_prob"] = moe.norm_topk_prob
    return out


def read_gguf_footprint(path: str | Path) -> tuple[int, int, int, int, int, tuple[int, ...] | None]:
    """A GGUF's (layers, KV heads, head_dim, parameters, query heads, per-layer windows or None)
    from its metadata and tensor shapes, nothing dequantized (model/checkpoints/footprint.py
    makes the Footprint): the windows as the family reads them from the metadata for its config
    (Gemma's window and layer pattern)."""
    meta = _open(Path(path))
    arch, fam = _family(meta)
    assert fam.gguf is not None
    heads = int(meta.need(f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv") or heads)
    hidden = int(meta.need(f"{arch}.embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    layers = int(meta.need(f"{arch}.block_count"))
    params = sum(int(np.prod(t.shape)) for t in meta.reader.tensors if t.name != _ROPE_FREQS)
    windows = None
    if fam.gguf.read_config is not None:  # (the families whose files carry windows)
        cfg: dict[str, Any] = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
                               "head_dim": head_dim}  # fmt: skip
        cfg |= fam.gguf.read_config(meta.get, cfg) | fam.gguf.config
        opts = fam.options(cfg, str(path))
        if opts.get("sliding_window"):
            slides = opts.get("sliding_layers") or (True,) * layers
            windows = tuple(opts["sliding_window"] if s else 0 for s in slides)
    return layers, kv_heads, head_dim, params, heads, windows


def _hf_name(name: str, layer_names: dict[str, str]) -> tuple[str, int | None] | None:
    """The HF name of a GGUF tensor (`layer_names`: the family's, after "blk.N.") and, for one
    expert's tensor of an older file (`blk.N.ffn_gate.E.weight`), its expert E. A name with "{e}"
    and no expert is a stack of every expert's tensor."""
    if name in GGUF_TOP:
        return GGUF_TOP[name], None
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in layer_names:
            return f"model.layers.{idx}.{layer_names[rest]}", None
        one = re.fullmatch(r"(\w+)\.(\d+)\.weight", rest)
        if one and (key := f"{one[1]}.{{e}}.weight") in layer_names:
            return f"model.layers.{idx}.{layer_names[key]}", int(one[2])
    return None


def read_gguf_vocab(path: str | Path) -> GGUFVocab:
    return _vocab(_open(Path(path)))


def _vocab(meta: _Meta) -> GGUFVocab:
    path = meta.path
    model = meta.get("tokenizer.ggml.model")
    if model not in MODELS:
        raise ValueError(
            f"{path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and "
            f"SentencePiece 'llama' are)"
        )
    tokens = [str(t) for t in meta.need("tokenizer.ggml.tokens")]
    arch = meta.get("general.architecture")
    spm = model == "llama"

    def opt_id(key: str) -> int | None:
        v = meta.get(key)
        return None if v is None else int(v)

    return GGUFVocab(
        model=str(model),
        tokens=tokens,
        token_types=[int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))],
        merges=[] if spm else [str(m) for m in meta.need("tokenizer.ggml.merges")],
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        scores=[float(x) for x in meta.need("tokenizer.ggml.scores")] if spm else [],
        bos_id=opt_id("tokenizer.ggml.bos_token_id"),
        eos_id=opt_id("tokenizer.ggml.eos_token_id"),
        unk_id=opt_id("tokenizer.ggml.unknown_token_id"),
        pad_id=opt_id("tokenizer.ggml.padding_token_id"),
        # llama.cpp's defaults where the file is silent: SentencePiece adds BOS and a prefix space
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=spm and bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        chat_template=meta.get("tokenizer.chat_template"),
        max_length=int(meta.get(f"{arch}.context_length") or 8192),
    )


def load_gguf(path: str | Path) -> GGUFModel:
    meta = _open(Path(path))
    config, tensors = _weights(meta)
    tok_json, tok_cfg = build_tokenizer(_vocab(meta), str(path))
    return GGUFModel(config, tensors, tok_json, tok_cfg)


def load_gguf_tokenizer(path: str | Path):
    """The GGUF's tokenizer as a transformers tokenizer, built in memory."""
    return hf_tokenizer(*build_tokenizer(read_gguf_vocab(path), str(path)))


def gguf_tokenizer_dir(path: str | Path) -> Path:
    """A directory holding the GGUF's tokenizer files, for code that loads tokenizers by path
    (`AutoTokenizer.from_pretrained`). Content-addressed, so never stale and written once:
    $RINGSERVE_CACHE/gguf-tokenizers/<sha256 of the two files' bytes, 16 hex>/."""
    import hashlib
    import shutil
    import tempfile

    from ringserve.model.paths import cache_dir

    tok_json, tok_cfg = build_tokenizer(read_gguf_vocab(path), str(path))
    cfg_text = json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n"
    key = hashlib.sha256(tok_json.encode() + b"\0" + cfg_text.encode()).hexdigest()[:16]
    target = cache_dir("gguf-tokenizers", key)
    if (target / "tokenizer_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        (tmp / "tokenizer.json").write_text(tok_json)
        (tmp / "tokenizer_config.json").write_text(cfg_text)  # written last: marks completeness
        try:
            tmp.rename(target)
        except OSError:  # a concurrent call won the race with identical content
            if not (target / "tokenizer_config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an HF-format directory: config.json, model.safetensors (f32), tokenizer files,
    generation_config.json. `out_dir` is created; files in it are overwritten."""
    from safetensors.numpy import save_file

    g = load_gguf(gguf_path)
    parse_config(g.config, source=str(gguf_path))  # fail here, not when serving
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(g.config, indent=2) + "\n")
    save_file(
        {k: np.ascontiguousarray(v) for k, v in g.tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "tokenizer.json").write_text(g.tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(g.tokenizer_config, indent=2) + "\n")
    gen = {
        k: g.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if g.config[k] is not None
    }
    (out / "generation_config.json").write_text(json.dumps({**gen, "do_sample": False}, indent=2) + "\n")
    return out
