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


def hf_repetition_greedy(path, prompts: list[list[int]], max_new_tokens: int, penalty: float) -> list[list[int]]:
    """Greedy continuations under HF's own RepetitionPenaltyLogitsProcessor (generate's
    `repetition_penalty`: over the prompt and the output), EOS ignored."""
    import torch

    m = hf_model(str(path))
    out = []
    with torch.no_grad():
        for p in prompts:
            g = m.generate(
                torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0, repetition_penalty=penalty,
            )  # fmt: skip
            out.append(g[0, len(p) :].tolist())
    return out


def reference_decode(path, prompt: list[int], max_new_tokens: int, *, repetition: float = 1.0, frequency: float = 0.0,
                     presence: float = 0.0, bias: dict[int, float] | None = None, min_new: int = 0,
                     held_back: tuple[int, ...] = (), temperature: float = 0.0, seed: int = 0,
                     stop: tuple[int, ...] = ()) -> list[int]:  # fmt: skip
    """One prompt's continuation by a reference of the semantics SGLang and vLLM give the
    sampling parameters, over HF's float32 logits, one full forward per token: stop ids held
    back below min_new, logit_bias added, HF's RepetitionPenaltyLogitsProcessor over prompt +
    output, frequency (count) and presence (once) penalties over the output, then greedy, or at
    `temperature` the Gumbel-max draw with ringserve's noise (model/runtime/sampler.py
    gumbel_noise: a function of seed and position only). Stops after a token of `stop`."""
    import jax.numpy as jnp
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    from ringserve.model.runtime.sampler import gumbel_noise

    m = hf_model(str(path))
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            x = m(torch.tensor([ids])).logits[0, -1].float()
            if len(out) < min_new:
                x[list(held_back)] = -float("inf")
            for t, b in (bias or {}).items():
                x[t] += b
            if repetition != 1.0:
                x = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), x[None])[0]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=len(x)).float() if out else torch.zeros_like(x)
            x = x - frequency * counts - presence * (counts > 0).float()
            if temperature > 0:
                seed32 = (seed ^ (seed >> 32)) & 0xFFFFFFFF
                noise = np.asarray(gumbel_noise(jnp.array([seed32], jnp.uint32), jnp.array([len(ids)], jnp.int32), len(x)))[0]
                t = int(np.argmax(x.numpy() / np.float32(temperature) + noise))
            else:
                t = int(torch.argmax(x))
            out.append(t)
            ids.append(t)
            if t in stop:
                break
    return out
