"""An engine with no max_total_tokens sizes its KV pool once, before its actors start, and every
actor holds that pool: the scheduler's books, the runner's KV arrays and get_server_info agree."""

from __future__ import annotations

from tests.engine.conftest import engine_ctx


def test_an_engine_sizes_its_pool_by_what_its_requests_need(tiny_dir):
    shapes = dict(max_running_requests=4, context_length=128, max_prefill_tokens=128, max_total_tokens=None)
    with engine_ctx(tiny_dir("llama"), page_size=16, **shapes) as engine:
        need = (4 * 8 + 1) * 16  # 4 requests x 8 pages of 16, and the sink page
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 4
        info = engine.get_server_info()
        assert info["server_args"]["max_total_tokens"] == engine.args.max_total_tokens == need
        assert info["server_args"]["mem_fraction_static"] == 0.2  # the CPU's default, resolved
        assert info["kv_pool"]["sized_by"] == "need" and info["kv_pool"]["kv_bytes"] == need * 4096
        assert info["max_total_num_tokens"] == engine.runner_info["kv_pool_tokens"] == need - 16
        assert engine.get_load()["max_total_num_tokens"] == need - 16  # the scheduler's books
