"""GGUF files of the mixture-of-experts families, written as llama.cpp's converter writes them
(tests/model/test_gguf.py `write_gguf`: each layer's experts stacked [E, out, in] as
`blk.N.ffn_{gate,up,down}_exps.weight`, the router `ffn_gate_inp` kept F32, Qwen2-MoE's shared
expert as `ffn_*_shexp`, Mixtral as arch `llama` with `llama.expert_count` and q/k permuted):
the same config and tensors as the HF directory, the same logits (F32: the directory's; F16 and
Q8_0: the directory's rounded through that type), the footprint, and refusals naming the file
and the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from ringserve.model.checkpoints.footprint import read_footprint
from ringserve.model.checkpoints.gguf import gguf_to_hf_dir, read_gguf_weights
from ringserve.model.checkpoints.load import load_checkpoint
from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.runtime.executor import ModelExecutor
from ringserve.model.runtime.weight_sync import WeightSync
from tests.hf_ref import hf_logits
from tests.model.test_gguf import CFG, Q, write_gguf

MOE = ["qwen3_moe", "qwen2_moe", "mixtral"]
PROMPT = np.random.default_rng(3).integers(3, 2000, 40).tolist()


def logits(ex: ModelExecutor) -> np.ndarray:
    out, _ = ex.logits([DeviceRow(np.array(PROMPT, np.int32), 0, np.arange(1, 5, dtype=np.int32))])
    return out[0]


def rounded_dir(src: Path, out: Path, qtype) -> Path:
    """The HF directory `src` with every weight `write_gguf` stores as `qtype` (2-D and 3-D, not the
    router) rounded through it by the gguf package, expert by expert: what a `qtype` file must serve."""
    from safetensors.numpy import save_file

    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    _, ref = load_checkpoint(src)
    save_file({k: a if a.ndim < 2 or k.endswith(".gate.weight") else gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
               for k, a in ref.items()}, str(out / "model.safetensors"))  # fmt: skip
    return out


@pytest.mark.parametrize("family", MOE)
def test_a_moe_gguf_loads_to_the_directorys_config_tensors_and_logits(tiny_dir, tmp_path, family):
    """qwen3_moe: q/k norms, top-k renormalized (llama.cpp's qwen3moe always does); qwen2_moe: q/k/v
    biases, the shared expert and its gate, not renormalized; mixtral: arch `llama` with experts,
    permuted q/k, each expert's size in feed_forward_length. The F32 file serves the directory's
    logits exactly (its weights loaded into the directory's executor), F16 and Q8_0 files those
    of the directory rounded through the type; quantized experts are the stack's own rows."""
    src = tiny_dir(family)
    ref_config, ref = load_checkpoint(src)
    path = write_gguf(src, tmp_path / "f32.gguf")
    config, tensors = load_checkpoint(path)
    assert config == ref_config and config.num_experts == 8
    assert sorted(tensors) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(tensors[k], ref[k], err_msg=k)

    ex = ModelExecutor(src, CFG)
    f32 = logits(ex)
    sync = WeightSync(ex)
    sync.load_disk(str(path))
    np.testing.assert_array_equal(logits(ex), f32)
    for qtype in (Q.F16, Q.Q8_0):
        sync.load_disk(str(rounded_dir(src, tmp_path / qtype.name, qtype)))
        want = logits(ex)
        quantized = write_gguf(src, tmp_path / f"{qtype.name}.gguf", qtype=qtype)
        sync.load_disk(str(quantized))
        np.testing.assert_array_equal(logits(ex), want, err_msg=qtype.name)
        assert not np.array_equal(want, f32)
    raw = {t.name: t for t in gguf.GGUFReader(str(quantized)).tensors}  # the Q8_0 file
    stack = raw["blk.1.ffn_down_exps.weight"]
    assert stack.tensor_type == Q.Q8_0 and raw["blk.1.ffn_gate_inp.weight"].tensor_type == Q.F32
    every = gguf.quants.dequantize(stack.data, stack.tensor_type)  # [E, out, in]
    _, got = read_gguf_weights(quantized)
    down = "down_proj" if family != "mixtral" else "w2"
    for e in range(8):
        name = next(
            k for k in got if k.startswith("model.layers.1.") and k.endswith(f".experts.{e}.{down}.weight")
        )
        np.testing.assert_array_equal(got[name], every[e], err_msg=name)


@pytest.mark.parametrize(
    "family", [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.sweep) for f in MOE]
)
def test_a_moe_ggufs_hf_directory_reads_as_the_original_in_hf(tiny_dir, tmp_path, family):
    """`gguf_to_hf_dir` (what fetch-model writes): HF transformers reads its config.json as the
    original's, e.g. Qwen3-MoE's norm_topk_prob, which HF defaults to false and llama.cpp's
    qwen3moe holds true: HF's logits equal the original directory's."""
    src = tiny_dir(family)
    hf_dir = gguf_to_hf_dir(write_gguf(src, tmp_path / "f.gguf"), tmp_path / "hf")
    want = hf_logits(src, PROMPT)
    np.testing.assert_allclose(hf_logits(hf_dir, PROMPT), want, rtol=0, atol=1e-6 * np.abs(want).max())


def test_older_mixtral_files_hold_one_tensor_per_expert(tiny_dir, tmp_path):
    """llama.cpp's first Mixtral files: `blk.N.ffn_gate.E.weight` per expert, read to the same tensors."""
    src = tiny_dir("mixtral")
    path = write_gguf(src, tmp_path / "m.gguf", per_expert=True)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "blk.0.ffn_up.7.weight" in names and not any("_exps" in n for n in names)
    (config, tensors), (ref_config, ref) = load_checkpoint(path), load_checkpoint(src)
    assert config == ref_config and sorted(tensors) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(tensors[k], ref[k], err_msg=k)


@pytest.mark.parametrize("family", MOE)
def test_a_moe_ggufs_footprint_counts_every_expert(tiny_dir, tmp_path, family):
    src = tiny_dir(family)
    fp = read_footprint(write_gguf(src, tmp_path / "f.gguf"))
    assert fp == read_footprint(src)
    assert fp.num_params == sum(a.size for a in load_checkpoint(src)[1].values())


def test_what_a_moe_gguf_may_not_hold(tiny_dir, tmp_path):
    """Dense layers among the sparse ones (by metadata or by tensor), a routing weight scale,
    a missing expert count, and a stack of the wrong number of experts: each refused naming the
    file and the key or tensor."""
    src = tiny_dir("qwen3_moe")
    dense = write_gguf(src, tmp_path / "d.gguf", extra=lambda w: w.add_leading_dense_block_count(1))
    with pytest.raises(
        ValueError,
        match=r"d\.gguf: qwen3moe\.leading_dense_block_count=1: the first 1 layers have dense MLPs",
    ):
        load_checkpoint(dense)
    mlp = write_gguf(
        src,
        tmp_path / "m.gguf",
        extra=lambda w: w.add_tensor("blk.2.ffn_up.weight", np.zeros((4, 32), np.float32)),
    )
    with pytest.raises(
        ValueError,
        match=r"m\.gguf: layer 2 has a dense MLP \('blk\.2\.ffn_up\.weight'\) where 'qwen3moe' has experts",
    ):
        load_checkpoint(mlp)
    scaled = write_gguf(src, tmp_path / "s.gguf", extra=lambda w: w.add_expert_weights_scale(2.5))
    with pytest.raises(ValueError, match=r"s\.gguf: qwen3moe\.expert_weights_scale=2\.5 is not supported"):
        load_checkpoint(scaled)
    for key, value in (("expert_count", None), ("expert_count", 4)):
        bad = write_gguf(src, tmp_path / "e.gguf", moe_meta={key: value})
        msg = (
            r"missing GGUF metadata 'qwen3moe\.expert_count'"
            if value is None
            else (
                r"tensor 'blk\.0\.ffn_(gate|up|down)_exps\.weight' has shape \[8, \d+, \d+\], expected \[qwen3moe\.expert_count"
            )
        )
        with pytest.raises(ValueError, match=r"e\.gguf: " + msg):
            load_checkpoint(bad)


def test_every_familys_gguf_names_are_llama_cpps():
    """Each family's GGUF layer table against gguf-py's own tensor map (llama.cpp's converter maps
    HF names through it; a merged expert stack is HF's name without the expert index), so the
    tables and `write_gguf` (written out independently) cannot agree on a name llama.cpp does not
    write. Gemma 2 shares Gemma 3's table, whose q/k norms it lacks."""
    from ringserve.model.families import FAMILIES

    lacking = {("gemma2", "attn_q_norm.weight"), ("gemma2", "attn_k_norm.weight")}
    checked = 0
    for fam in FAMILIES.values():
        if fam.gguf is None:
            continue
        arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == fam.gguf.arch)
        names = gguf.get_tensor_name_map(arch, 1)
        for key, hf in fam.gguf.layer.items():
            if "{e}" in key:  # older Mixtral files' one tensor per expert: no longer in the map
                continue
            got = names.get_name(f"model.layers.0.{hf.replace('.{e}', '')}", try_suffixes=(".weight", ".bias"))
            assert got == (None if (fam.name, key) in lacking else f"blk.0.{key}"), (fam.name, key, hf)
            checked += 1
    assert checked > 60
