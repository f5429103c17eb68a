"""Routed expert ids (routing replay, `return_routed_experts`) between the actors and to the user.

Between the actors an id travels in the narrowest integer that holds every expert: uint8 up
to 256 experts, int16 beyond (Qwen3-30B-A3B's 128: one byte an id, 48 x 8 = 384 bytes a
token). To the user it is SGLang's `meta_info["routed_experts"]`: base64 of little-endian
int32 ids shaped [positions, MoE layers, top-k], which verl, slime and AReaL decode as

    np.frombuffer(base64.b64decode(s), np.int32).reshape(-1, num_layers, topk)

(`decode` below), positions [routed_experts_start_len, prompt + output - 1): every position
whose forward ran, the last output token's never does.
"""

from __future__ import annotations

import base64

import numpy as np


def wire_dtype(num_experts: int) -> np.dtype:
    """The integer an id of `num_experts` experts travels in between the actors."""
    if not 0 < num_experts <= 1 << 15:
        raise ValueError(f"num_experts={num_experts}: routed experts travel as int16 at most (1 to 32768 experts)")
    return np.dtype(np.uint8 if num_experts <= 1 << 8 else "<i2")


def dtype_of(itemsize: int) -> np.dtype:
    """The wire dtype a message names by its item size (1: uint8, 2: int16)."""
    return np.dtype(np.uint8 if itemsize == 1 else "<i2")


def encode(ids: np.ndarray) -> str:
    """SGLang's meta_info["routed_experts"]: base64 of the ids as little-endian int32."""
    return base64.b64encode(np.ascontiguousarray(ids, "<i4").tobytes()).decode("ascii")


def decode(text: str, num_layers: int, topk: int) -> np.ndarray:
    """meta_info["routed_experts"] back to int32 [positions, num_layers, topk] (a client's side)."""
    return np.frombuffer(base64.b64decode(text), "<i4").reshape(-1, num_layers, topk)
