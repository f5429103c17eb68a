"""LoRA on the model runtime alone: the adapter pool and the per-row batched product against
Hugging Face transformers + PEFT on the same tiny checkpoint and adapters (greedy tokens equal),
one adapter alone and three adapters with a row without any in one batch; the PEFT reader's
refusals; loading and unloading slots never recompiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringserve.kvmem.allocator import cdiv
from ringserve.model.checkpoints.peft import TARGET_MODULES, read_adapter
from ringserve.model.checkpoints.tiny_lora import make_tiny_lora
from ringserve.model.compute.step_inputs import DeviceRow
from ringserve.model.families import read_config
from ringserve.model.layers.lora import lora_delta
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.hf_ref import hf_lora_greedy

PAGE = 16
N_NEW = 8


@pytest.fixture(scope="module")
def base(tiny_dir):
    return tiny_dir("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Three adapters: rank 8 on every module, rank 4 on attention only (rsLoRA), rank 2 on the MLP."""
    d = tmp_path_factory.mktemp("loras")
    return [
        make_tiny_lora(d / "a", base, rank=8, seed=1),
        make_tiny_lora(d / "b", base, rank=4, seed=2, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                       alpha=8, use_rslora=True),
        make_tiny_lora(d / "c", base, rank=2, seed=3, target_modules=("gate_proj", "up_proj", "down_proj"), alpha=4),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ex(base):
    cfg = ExecutorConfig(page_size=PAGE, num_pages=256, max_context_len=512, max_batch=8, max_extend_tokens=512,
                         extend_block=16, precompile=False, lora_slots=4, lora_rank=8, lora_targets=TARGET_MODULES)  # fmt: skip
    return ModelExecutor(base, cfg)


def greedy(ex: ModelExecutor, prompts: list[list[int]], slots: list[int], n_new: int) -> list[list[int]]:
    """Every prompt prefilled in one extend step (rows of different adapters together), then
    decoded together; each row carries its adapter slot."""
    tables, nxt = [], 1
    for p in prompts:
        need = cdiv(len(p) + n_new, PAGE)
        tables.append(np.arange(nxt, nxt + need, dtype=np.int32))
        nxt += need
    rows = [DeviceRow(np.array(p, np.int32), 0, t, lora_slot=s) for p, t, s in zip(prompts, tables, slots, strict=True)]
    out, idx, _ = ex.run(rows)
    toks = np.asarray(out.tokens)
    gen = [[int(toks[i])] for i in idx]
    for _ in range(n_new - 1):
        rows = [DeviceRow(np.array([g[-1]], np.int32), len(p) + len(g) - 1, t, lora_slot=s)
                for p, g, t, s in zip(prompts, gen, tables, slots, strict=True)]  # fmt: skip
        out, idx, _ = ex.run(rows)
        toks = np.asarray(out.tokens)
        for g, i in zip(gen, idx, strict=True):
            g.append(int(toks[i]))
    return gen


def test_mixed_batch_equals_peft(ex, base, adapters):
    """Rows of adapters a, b, c and of none in one batch, each equal to HF + PEFT with its own
    adapter (prefill in one extend step, then decode steps)."""
    cfg = read_config(base)
    for slot, path in enumerate(adapters, start=1):
        ex.lora.write(slot, read_adapter(path, cfg, 8, TARGET_MODULES))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 2000, n).tolist() for n in (70, 33, 90, 51, 12, 64, 40, 25)]
    slots = [1, 2, 3, 0, 3, 0, 2, 1]
    got = greedy(ex, prompts, slots, N_NEW)
    assert sum(map(len, prompts)) > 256
    want = [None] * len(prompts)
    for slot, path in [(0, None)] + list(enumerate(adapters, start=1)):
        mine = [i for i, s in enumerate(slots) if s == slot]
        for i, w in zip(mine, hf_lora_greedy(base, path, [prompts[i] for i in mine], N_NEW), strict=True):
            want[i] = w
    assert got == want
    base_only = hf_lora_greedy(base, None, prompts[:3], N_NEW)
    assert all(got[i] != base_only[i] for i in range(3)), "the adapters changed nothing: the test could not fail"


def test_one_adapter_alone_and_slot_reuse(ex, base, adapters):
    """One adapter alone; then its slot rewritten with another adapter, then cleared: each time
    the outputs follow, and the programs and the slot writer never compiled again."""
    cfg = read_config(base)
    prompts = [np.random.default_rng(1).integers(3, 2000, 40).tolist()]
    ex.lora.write(1, read_adapter(adapters[0], cfg, 8, TARGET_MODULES))
    assert greedy(ex, prompts, [1], N_NEW) == hf_lora_greedy(base, adapters[0], prompts, N_NEW)
    traces, writes = ex.trace_count, ex.lora.write_traces
    ex.lora.write(1, read_adapter(adapters[2], cfg, 8, TARGET_MODULES))
    assert greedy(ex, prompts, [1], N_NEW) == hf_lora_greedy(base, adapters[2], prompts, N_NEW)
    ex.lora.clear(1)
    assert greedy(ex, prompts, [1], N_NEW) == hf_lora_greedy(base, None, prompts, N_NEW)
    assert (ex.trace_count, ex.lora.write_traces) == (traces, writes) and writes == 1


def test_release_and_resume_keep_adapters(ex, base, adapters):
    cfg = read_config(base)
    ex.lora.write(2, read_adapter(adapters[1], cfg, 8, TARGET_MODULES))
    prompts = [np.random.default_rng(2).integers(3, 2000, 30).tolist()]
    before = greedy(ex, prompts, [2], 4)
    ex.lora.release()
    with pytest.raises(RuntimeError, match="released"):
        greedy(ex, prompts, [2], 1)
    ex.lora.resume()
    assert greedy(ex, prompts, [2], 4) == before


@pytest.mark.slow
@pytest.mark.parametrize("gather, layer_loop", [(True, "unrolled"), (False, "scan")])
def test_gather_form_and_scanned_layers_equal_peft(base, adapters, gather, layer_loop):
    """The gather form (ExecutorConfig.lora_gather) and the scanned layer layout (accelerators':
    the pool stacked over the layers) serve the same tokens."""
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=256,
                         extend_block=16, precompile=False, lora_slots=2, lora_rank=8, lora_targets=TARGET_MODULES,
                         lora_gather=gather, layer_loop=layer_loop)  # fmt: skip
    ex = ModelExecutor(base, cfg)
    ex.lora.write(1, read_adapter(adapters[0], read_config(base), 8, TARGET_MODULES))
    prompts = [np.random.default_rng(3).integers(3, 2000, n).tolist() for n in (20, 31)]
    got = greedy(ex, prompts, [1, 0], N_NEW)
    assert got == [hf_lora_greedy(base, adapters[0], prompts[:1], N_NEW)[0], hf_lora_greedy(base, None, prompts[1:], N_NEW)[0]]


def test_delta_forms_agree():
    """The gather and dense forms of the per-token product are the same math."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    s, r, n_in, n_out, t = 4, 8, 32, 24, 300
    a, b = rng.standard_normal((s, r, n_in)).astype(np.float32), rng.standard_normal((s, r, n_out)).astype(np.float32)
    a[0], b[0] = 0, 0
    x, slot = rng.standard_normal((t, n_in)).astype(np.float32), rng.integers(0, s, t).astype(np.int32)
    scale = np.array([0, 1, 0.5, 2], np.float32)
    want = np.einsum("tr,tro->to", np.einsum("ti,tri->tr", x, a[slot]) * scale[slot, None], b[slot])
    dense = np.asarray(lora_delta(jnp.asarray(x), a, b, jnp.asarray(slot), jnp.asarray(scale)))
    gather = np.asarray(lora_delta(jnp.asarray(x), a, b, jnp.asarray(slot), jnp.asarray(scale), gather=True))
    np.testing.assert_allclose(dense, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gather, want, rtol=1e-4, atol=1e-4)


def _edit(path, **changes):
    conf = json.loads((path / "adapter_config.json").read_text())
    conf.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(conf))


def test_reader_refusals(base, tmp_path):
    cfg = read_config(base)
    good = make_tiny_lora(tmp_path / "good", base, rank=8, seed=1)
    with pytest.raises(ValueError, match="rank r=8 exceeds the server's max_lora_rank=4"):
        read_adapter(good, cfg, 4, TARGET_MODULES)
    with pytest.raises(ValueError, match="'k_proj' is not among the server's lora_target_modules"):
        read_adapter(good, cfg, 8, ("q_proj", "v_proj"))
    with pytest.raises(ValueError, match="no such directory"):
        read_adapter(tmp_path / "nowhere", cfg, 8, TARGET_MODULES)
    bad = make_tiny_lora(tmp_path / "dora", base, rank=2)
    _edit(bad, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        read_adapter(bad, cfg, 8, TARGET_MODULES)
    bad = make_tiny_lora(tmp_path / "unknown", base, rank=2)
    _edit(bad, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="target module 'lm_head' is unknown"):
        read_adapter(bad, cfg, 8, TARGET_MODULES)
    other = tmp_path / "other-base"
    from ringserve.model.checkpoints.tiny import make_tiny_model

    make_tiny_model(other, "llama", seed=0, hidden_size=128, intermediate_size=320, num_attention_heads=4,
                    num_key_value_heads=2)  # fmt: skip
    wrong = make_tiny_lora(tmp_path / "wrong-shapes", other, rank=2)
    with pytest.raises(ValueError, match=r"lora_A.weight. has shape \(2, \d+\), expected \(2, \d+\)"):
        read_adapter(wrong, cfg, 8, TARGET_MODULES)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "gemma2"])
def test_other_families_equal_peft(tiny_dir, tmp_path, family):
    """Qwen3 (q/k norms, head_dim 48: q_proj 256 -> 384, o_proj 384 -> 256), Qwen2 (qkv
    biases, untied head) and Gemma 2 (the sandwich layer's GeGLU, a 25-token prompt past its
    window of 24): an adapter's rows beside a base row equal HF + PEFT."""
    base = tiny_dir(family)
    cfg = ExecutorConfig(page_size=PAGE, num_pages=64, max_context_len=256, max_batch=4, max_extend_tokens=256,
                         extend_block=16, precompile=False, lora_slots=2, lora_rank=8, lora_targets=TARGET_MODULES)  # fmt: skip
    ex = ModelExecutor(base, cfg)
    adapter = make_tiny_lora(tmp_path / "a", base, rank=8, seed=4)
    ex.lora.write(1, read_adapter(adapter, read_config(base), 8, TARGET_MODULES))
    prompts = [np.random.default_rng(5).integers(3, 2000, n).tolist() for n in (25, 18)]
    got = greedy(ex, prompts, [1, 0], N_NEW)
    assert got[0] == hf_lora_greedy(base, adapter, prompts[:1], N_NEW)[0]
    assert got[1] == hf_lora_greedy(base, None, prompts[1:], N_NEW)[0]
    assert got[0] != hf_lora_greedy(base, None, prompts[:1], N_NEW)[0], 'the adapter changed nothing'
