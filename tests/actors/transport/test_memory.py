"""The KV pool's size, decided once before any actor starts (actors/transport/memory.py): the
smaller of what the running requests can use and what mem_fraction_static leaves after the
weights; an explicit max_total_tokens wins; nothing that fits is a ValueError naming the numbers."""

from __future__ import annotations

import pytest

from ringserve.actors.server_args import ServerArgs
from ringserve.actors.transport import memory
from ringserve.actors.transport.memory import need_tokens, resolve_memory, size_pool
from ringserve.model.checkpoints.footprint import Footprint, read_footprint

TINY = Footprint(num_layers=4, num_kv_heads=4, head_dim=32, num_params=3_279_104, num_heads=8)  # the tiny Llama
SMOLLM2 = Footprint(num_layers=30, num_kv_heads=3, head_dim=64, num_params=134_515_008, num_heads=9)  # SmolLM2-135M
GIB = 1 << 30


def probe(monkeypatch, nbytes: int | None) -> list[str]:
    """Replace the device memory probe: every call's platform is recorded."""
    asked: list[str] = []

    def fake(plat, env=None):
        asked.append(plat)
        return nbytes

    monkeypatch.setattr(memory, "device_memory_bytes", fake)
    return asked


def test_the_tiny_models_footprint_is_read_from_its_directory(tiny_dir):
    fp = read_footprint(tiny_dir("llama"))
    assert fp == TINY
    assert fp.kv_bytes_per_token("float32") == 2 * 4 * 4 * 32 * 4 == 4096
    assert fp.kv_bytes_per_token("bfloat16") == 2048 and fp.weight_bytes("float32") == 4 * 3_279_104


def test_a_token_costs_what_the_attention_backends_layout_holds():
    """The pool is sized in the layout of the backend that will hold it (model/compute/attention/
    layout.py): SmolLM2 (3 KV heads of 64) in jax's TPU kernel pads to 4 heads of 128 lanes
    (2.67x), ringserve's holds it unpadded; KV heads fewer than tp are copied by ringserve's."""
    assert SMOLLM2.kv_bytes_per_token("bfloat16") == 30 * 3 * 2 * 64 * 2 == 23_040
    assert SMOLLM2.kv_bytes_per_token("bfloat16", "auto", "tpu") == 30 * 4 * 256 * 2 == 61_440  # pallas
    assert SMOLLM2.kv_bytes_per_token("bfloat16", "pallas_ragged", "tpu") == 23_040
    assert SMOLLM2.kv_bytes_per_token("bfloat16", "auto", "cuda") == 23_040
    qwen3_moe = Footprint(num_layers=48, num_kv_heads=4, head_dim=128, num_params=1, num_heads=32)
    assert qwen3_moe.kv_bytes_per_token("bfloat16", "pallas_ragged", "tpu", tp=8) == 48 * 8 * 256 * 2  # 2 copies
    assert qwen3_moe.kv_bytes_per_token("bfloat16", "pallas", "tpu", tp=8) == 48 * 4 * 256 * 2  # (not split)
    args = ServerArgs(page_size=64, max_running_requests=256, dtype="bfloat16")  # the launcher's, on a v5e
    jax_kernel = size_pool(args, SMOLLM2, "tpu", 16 * 10**9)
    assert jax_kernel.kv_bytes_per_token == 61_440
    assert jax_kernel.max_total_tokens * 61_440 + SMOLLM2.weight_bytes("bfloat16") <= 0.85 * 16e9
    ours = size_pool(args.replace(attention_backend="pallas_ragged"), SMOLLM2, "tpu", 16 * 10**9)
    assert ours.max_total_tokens > 2.6 * jax_kernel.max_total_tokens


def test_the_tiny_model_gets_what_its_requests_need(tiny_dir, monkeypatch):
    probe(monkeypatch, 16 * GIB)
    args, pool = resolve_memory(ServerArgs(max_running_requests=4, context_length=100, page_size=16),
                                tiny_dir("llama"), env={"JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert need_tokens(args) == (4 * 7 + 1) * 16 == 464  # 4 requests x 7 pages, + the sink page
    assert (args.max_total_tokens, args.num_pages, args.mem_fraction_static) == (464, 29, 0.2)
    assert (pool.sized_by, pool.need_tokens, pool.kv_bytes) == ("need", 464, 464 * 4096)
    assert pool.budget_tokens == (int(0.2 * 16 * GIB) - 4 * 3_279_104) // 4096 // 16 * 16


def test_defaults_are_capped_by_the_memory_fraction():
    """SmolLM2 in f32 with 64 requests of 4096 tokens would need 12 GB of KV; 8 GiB of memory at
    the CPU's 0.2 gives it 1.6 GiB less the weights."""
    pool = size_pool(ServerArgs(), SMOLLM2, "cpu", 8 * GIB)
    assert pool.need_tokens == (64 * 256 + 1) * 16 == 262_160
    budget = (int(0.2 * 8 * GIB) - 4 * 134_515_008) // 46_080 // 16 * 16
    assert (pool.sized_by, pool.max_total_tokens, pool.budget_tokens) == ("mem_fraction_static", budget, budget)
    assert budget == 25600 and pool.max_total_tokens % 16 == 0
    gpu = size_pool(ServerArgs(dtype="bfloat16", mem_fraction_static=0.9), SMOLLM2, "cuda", 80 * GIB)
    assert (gpu.sized_by, gpu.max_total_tokens, gpu.mem_fraction_static) == ("need", 262_160, 0.9)
    assert size_pool(ServerArgs(), SMOLLM2, "tpu", 16 * GIB).mem_fraction_static == 0.85


def test_an_explicit_max_total_tokens_wins_and_the_memory_is_not_asked(tiny_dir, monkeypatch):
    asked = probe(monkeypatch, 1)  # would fit nothing
    args, pool = resolve_memory(ServerArgs(max_total_tokens=1000, context_length=512), tiny_dir("llama"))
    assert (args.max_total_tokens, args.num_pages, pool.sized_by, pool.budget_tokens) == (1000, 62, "max_total_tokens", None)
    assert asked == []


def test_nothing_fits_names_the_fields_and_numbers(tiny_dir, monkeypatch):
    probe(monkeypatch, 100 * (1 << 20))  # 100 MiB: a fifth of it, less 12.5 MiB of weights, holds 1904 tokens
    with pytest.raises(ValueError) as e:
        resolve_memory(ServerArgs(), tiny_dir("llama"), env={"JAX_PLATFORMS": "cpu"})
    msg = str(e.value)
    assert msg.startswith("the KV pool does not fit: mem_fraction_static=0.2 x 104,857,600 B of host RAM available - "
                          "13,116,416 B of weights = 1,904 tokens at 4,096 B a token")  # fmt: skip
    assert "fewer than the 4,128 tokens one request of context_length=4096 plus a page needs" in msg
    args, _ = resolve_memory(ServerArgs(context_length=512), tiny_dir("llama"), env={"JAX_PLATFORMS": "cpu"})
    assert args.max_total_tokens == 1904  # the same memory holds a shorter context


def test_many_hosts_size_by_need_so_that_every_host_agrees():
    a = ServerArgs(nnodes=2, tp_size=2, dist_init_addr="127.0.0.1:1234", max_running_requests=2, context_length=64)
    pool = size_pool(a, TINY, "cpu", 64 * GIB)
    assert (pool.sized_by, pool.max_total_tokens) == ("need", (2 * 4 + 1) * 16)
    big = ServerArgs(nnodes=2, tp_size=2, dist_init_addr="127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"max_total_tokens: on many hosts the KV pool is sized by need"):
        size_pool(big, SMOLLM2, "cpu", 8 * GIB)


def test_data_parallel_groups_share_the_host_but_not_a_gpu(monkeypatch):
    probe(monkeypatch, 8 * GIB)
    assert memory.group_memory(ServerArgs(dp_size=2, tp_size=2), "cpu") == 4 * GIB
    assert memory.group_memory(ServerArgs(dp_size=2, tp_size=2), "cuda") == 16 * GIB


def test_an_unknown_memory_sizes_by_need(tiny_dir, monkeypatch):
    probe(monkeypatch, None)
    args, pool = resolve_memory(ServerArgs(max_running_requests=2, context_length=32), tiny_dir("llama"))
    assert (pool.sized_by, args.max_total_tokens, pool.budget_tokens) == ("need", 80, None)


def test_the_host_memory_probe_reads_meminfo():
    from ringserve.actors.transport.devices import device_memory_bytes

    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024
    got = device_memory_bytes("cpu")
    assert got is not None and abs(got - avail) < avail // 10  # it moves between the two reads
