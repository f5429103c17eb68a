"""Reference outputs from Hugging Face transformers (PyTorch, CPU, float32)."""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=8)
def hf_model(path: str, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    m.eval()
    return m


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations, one prompt at a time (no padding), EOS ignored."""
    import torch

    m = hf_model(str(path))
    out = []
    with torch.no_grad():
        for p in prompts:
            g = m.generate(
                torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(g[0, len(p) :].tolist())
    return out


def hf_logits(path, prompt: list[int]) -> np.ndarray:
    """Float32 logits [len(prompt), vocab] of one prompt."""
    import torch

    m = hf_model(str(path))
    with torch.no_grad():
        return m(torch.tensor([prompt])).logits[0].float().numpy()


def hf_logprobs(path, prompt: list[int]) -> np.ndarray:
    """Log-softmax [len(prompt), vocab] of HF's float32 logits (taken in float64)."""
    x = hf_logits(path, prompt).astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def hf_lora_greedy(path, adapter, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of the base checkpoint at `path` with PEFT's LoRA adapter at
    `adapter` (None: the base alone), one prompt at a time, EOS ignored."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if adapter is None:
        return hf_greedy(path, prompts, max_new_tokens)
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    m = PeftModel.from_pretrained(base, str(adapter)).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = m.generate(
                input_ids=torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            out.append(g[0, len(p) :].tolist())
    return out
