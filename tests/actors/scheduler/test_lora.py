"""The scheduler's LoRA part on CPU: the adapter table (slots, refusals) and the prefix cache
keyed by adapter load (a prefix cached under one adapter is never granted to another, to the
base model, or to a later load of the same name), with the fake runner's exact books."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.actors.scheduler.core import SchedulerCore
from ringserve.actors.scheduler.lora import LoraTable, cache_key
from ringserve.actors.server_args import ServerArgs
from ringserve.kvmem import KVCache
from tests.actors.scheduler.fake_runner import FakeRunner
from tests.actors.scheduler.test_scheduler import VOCAB, drive, letters, req


def make(num_pages: int = 64, page: int = 4, **kw):
    """A core with the prefix cache on."""
    args = ServerArgs(page_size=page, max_total_tokens=num_pages * page, max_running_requests=8,
                      context_length=(num_pages - 2) * page, **kw)  # fmt: skip
    books = KVCache(num_pages, page, 8)
    return SchedulerCore(args, books, letters), FakeRunner(page, VOCAB), books


def test_table_slots_and_refusals():
    t = LoraTable(2, {"a": "/a"})
    assert t.get("a").slot == 1 and t.free_slot("b") == 2
    t.add("b", "/b", 2)
    with pytest.raises(ValueError, match="all 2 LoRA slots are taken"):
        t.free_slot("c")
    with pytest.raises(ValueError, match="lora_name='a' is already loaded"):
        t.free_slot("a")
    with pytest.raises(ValueError, match=r"lora_path='c': no LoRA adapter of that name is loaded \(loaded: \['a', 'b'\]\)"):
        t.get("c")
    first = t.remove("a")
    assert t.free_slot("a") == 1
    again = t.add("a", "/a", 1)
    assert cache_key("3", first) != cache_key("3", again) != cache_key("3", None) == "3"


def test_prefix_cache_is_keyed_by_adapter():
    core, runner, books = make(num_pages=64, page=4, enable_lora=True, lora_paths=["a=/a", "b=/b"])
    prompt = list(range(10, 30))

    def run(rid: str, lora: str | None) -> int:
        r = req(rid, prompt, 2)
        core.add_request(r, lora)
        drive(core, runner)
        return r.cached_tokens

    assert [run("a1", "a"), run("b1", "b"), run("n1", None)] == [0, 0, 0]
    assert [run("a2", "a"), run("b2", "b"), run("n2", None)] == [16, 16, 16]  # each its own, 4 pages
    core.loras.remove("a")
    core.loras.add("a", "/a2", 1)  # a new load of the name: its old prefixes never match
    assert run("a3", "a") == 0
    core.check_idle()


def test_unknown_adapter_and_users():
    core, runner, books = make(num_pages=64, page=4, enable_lora=True, lora_paths=["a=/a"])
    with pytest.raises(ValueError, match="lora_path='x'"):
        core.add_request(req("r", [1, 2, 3], 2), "x")
    core.add_request(req("r", [1, 2, 3], 2), "a")
    assert core.lora_users("a") == 1
    batch = core.get_next_batch()
    assert batch is not None and batch.rows[0].req.lora is not None and batch.rows[0].req.lora.slot == 1
    core.process_result(batch, runner.run(batch))
    drive(core, runner)
    assert core.lora_users("a") == 0
    plain, _, _ = make(num_pages=64, page=4)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.add_request(req("r", [1, 2, 3], 2), "a")
    assert np.all(books.slots.live == 0)
