"""ServerArgs: frozen, validated once with field-naming errors, CLI generated from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from ringserve.actors.server_args import ServerArgs
from ringserve.actors.server_options import SECTIONS
from ringserve.model.compute.options import ComputeOptions, flat_fields


def parse(argv: list[str]) -> ServerArgs:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return ServerArgs.from_cli_args(p.parse_args(argv))


def test_every_field_has_a_flag_and_defaults_round_trip():
    assert parse([]) == ServerArgs()
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    flags = {a.dest for a in p._actions}
    assert set(flat_fields(ServerArgs())) <= flags
    # one --help group per section, holding exactly that section's flags
    groups = {g.title: {a.dest for a in g._group_actions} for g in p._action_groups}
    for tp, title in SECTIONS.values():
        assert groups[title] == {f.name for f in dataclasses.fields(tp)}, title


def test_options_live_in_sections_and_read_flat():
    """Each option belongs to one section; the flat name reads it (SGLang's view); a section
    travels whole (the runner hands `compute` to the executor as it is)."""
    a = ServerArgs(page_size=8, dtype="bfloat16", tp_size=2, enable_lora=True)
    assert (a.memory.page_size, a.compute.dtype, a.parallel.tp_size, a.lora.enable_lora) == (8, "bfloat16", 2, True)
    assert (a.page_size, a.dtype, a.tp_size, a.enable_lora) == (8, "bfloat16", 2, True)
    assert a.compute == ComputeOptions(dtype="bfloat16")
    assert ServerArgs(compute=a.compute, page_size=8).compute is a.compute  # a whole section, unchanged
    names = [f.name for tp, _ in SECTIONS.values() for f in dataclasses.fields(tp)]
    assert len(names) == len(set(names))  # a flat name is in one section only
    b = dataclasses.replace(a, max_total_tokens=65536)
    assert (b.max_total_tokens, b.page_size, b.compute) == (65536, 8, a.compute)
    with pytest.raises(AttributeError, match="no option 'page_sise'"):
        a.page_sise  # noqa: B018


def test_flags_parse_to_typed_fields():
    a = parse(["--page-size", "4", "--enable-mixed-chunk", "--schedule-policy", "lpm", "--model-path", "tiny", "--chunked-prefill-size", "-1"])
    assert (a.page_size, a.enable_mixed_chunk, a.schedule_policy, a.model_path, a.chunked_prefill_size) == (4, True, "lpm", "tiny", -1)
    assert parse(["--disable-overlap-schedule"]).enable_overlap is False


def test_lora_flags_are_sglangs():
    a = parse(["--enable-lora", "--max-lora-rank", "32", "--max-loras-per-batch", "2",
               "--lora-target-modules", "q_proj", "v_proj", "--lora-paths", "x=/a", "y=/b"])  # fmt: skip
    assert (a.enable_lora, a.max_lora_rank, a.max_loras_per_batch) == (True, 32, 2)
    assert a.lora_target_modules == ("q_proj", "v_proj") and a.lora_adapters == {"x": "/a", "y": "/b"}
    assert ServerArgs(enable_lora=True, lora_paths={"x": "/a"}).lora_paths == ("x=/a",)  # a dict keyword


def test_frozen():
    a = ServerArgs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.memory.page_size = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.memory = a.memory  # type: ignore[misc]
    with pytest.raises((dataclasses.FrozenInstanceError, TypeError)):  # (a flat name is a read-only view)
        a.page_size = 4  # type: ignore[misc]
    assert a.page_size == 16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(page_size=3), "page_size=3: must be a power of two"),
        (dict(schedule_policy="random"), "schedule_policy='random': choose one of ['fcfs', 'lpm']"),
        (dict(dtype="int4"), "dtype='int4': choose one of"),
        (dict(chunked_prefill_size=0), "chunked_prefill_size=0: -1 (off) or >= 1"),
        (dict(decode_bucket_step=-8), "decode_bucket_step=-8: must be >= 0"),
        (dict(ep_size=2), "ep_size=2: must be 1 or tp_size=1"),
        (dict(prefill_step_cost=-1), "prefill_step_cost=-1: must be >= 0"),
        (dict(max_total_tokens=16, page_size=16), "max_total_tokens=16: must hold at least 2 pages"),
        (dict(max_total_tokens=4096, context_length=4096, page_size=16),
         "max_total_tokens=4096: the KV pool must hold one request of context_length=4096 plus a page (4128 tokens)"),
        (dict(mem_fraction_static=0.0), "mem_fraction_static=0.0: must be in (0, 1]"),
        (dict(mem_fraction_static=1.5), "mem_fraction_static=1.5: must be in (0, 1]"),
        (dict(mem_fraction_static=-0.2), "mem_fraction_static=-0.2: must be in (0, 1]"),
        (dict(max_prefill_tokens=100), "max_prefill_tokens=100: must be a multiple of extend_block=16"),
        (dict(ring_bytes=5000), "ring_bytes=5000: must be a power of two"),
        (dict(pagesize=16), "unknown server option 'pagesize'; did you mean ['page_size'"),
        (dict(lora_paths=["a=/x"]), "lora_paths: adapters need enable_lora"),
        (dict(enable_lora=True, lora_paths=["a"]), "lora_paths: 'a' must be NAME=PATH"),
        (dict(enable_lora=True, lora_paths=["a=/x", "a=/y"]), "lora_paths: adapter name 'a' given twice"),
        (dict(enable_lora=True, max_loras_per_batch=1, lora_paths=["a=/x", "b=/y"]),
         "lora_paths: 2 adapters, more than max_loras_per_batch=1 slots"),
        (dict(enable_lora=True, lora_target_modules=["q_proj", "lm_head"]), "lora_target_modules=['q_proj', 'lm_head']: choose among"),
        (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank=0: must be in [1, 1024]"),
        (dict(enable_lora=True, enable_deterministic_inference=True), "enable_lora cannot be combined with enable_deterministic"),
    ],
)
def test_bad_options_name_the_field_and_limit(kwargs, message):
    with pytest.raises(ValueError) as e:
        ServerArgs.from_kwargs(**kwargs)
    assert message in str(e.value)


def test_num_pages_rounds_down():
    assert ServerArgs(max_total_tokens=1000, page_size=16, context_length=512).num_pages == 62


def test_the_pool_is_sized_at_start_up_unless_given():
    """max_total_tokens None: the frontend sizes the pool (actors/transport/memory.py) before any
    actor reads num_pages; a full fraction is allowed; the flags parse."""
    a = ServerArgs()
    assert (a.max_total_tokens, a.mem_fraction_static, a.min_pages) == (None, None, 258)
    with pytest.raises(RuntimeError, match="max_total_tokens is unresolved"):
        _ = a.num_pages
    assert ServerArgs(mem_fraction_static=1.0).mem_fraction_static == 1.0
    b = parse(["--mem-fraction-static", "0.3", "--max-total-tokens", "8192", "--context-length", "512"])
    assert (b.mem_fraction_static, b.max_total_tokens, b.num_pages) == (0.3, 8192, 512)


def test_constrained_json_whitespace_flags():
    assert ServerArgs().json_options == {}
    assert parse(["--constrained-json-disable-any-whitespace"]).json_options == {"whitespace_flexible": False}
    assert parse(["--constrained-json-whitespace-pattern", "[ ]{0,2}"]).json_options == {"whitespace_pattern": "[ ]{0,2}"}
    with pytest.raises(ValueError, match="cannot be combined"):
        ServerArgs(constrained_json_disable_any_whitespace=True, constrained_json_whitespace_pattern=" ")
    with pytest.raises(ValueError, match="(?s)constrained_json_whitespace_pattern='\\[ '.*unclosed character class"):
        ServerArgs(constrained_json_whitespace_pattern="[ ")


def test_many_hosts_flags():
    a = parse(["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.5:5000", "--tp-size", "8"])
    assert (a.multihost, a.dist_addr, a.relay_addr) == (True, ("10.0.0.5", 5000), ("10.0.0.5", 5001))
    assert parse(["--nnodes", "2", "--dist-init-addr", "[::1]:7", "--relay-port", "9", "--tp-size", "2"]).relay_addr == ("::1", 9)
    # many hosts never serve while compiling and are never restarted by the supervisor
    assert (a.serve_while_compiling, a.supervise) == (True, True)
    assert (a.background_compile, a.restartable) == (False, False)
    one = ServerArgs()
    assert (one.multihost, one.background_compile, one.restartable) == (False, True, True)
    # the relay's secret never shows in get_server_info
    assert parse(["--dist-token", "s3cret"]).public()["dist_token"] == "<secret>" and one.public()["dist_token"] is None
    assert one.public()["page_size"] == 16 and set(one.public()) == set(flat_fields(one))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(nnodes=2, tp_size=2), "needs dist_init_addr"),
        (dict(nnodes=2, tp_size=2, dist_init_addr="host"), "must be HOST:PORT"),
        (dict(nnodes=2, tp_size=3, dist_init_addr="h:1"), "tp_size=3: must be a multiple of nnodes=2"),
        (dict(nnodes=2, node_rank=2, tp_size=2, dist_init_addr="h:1"), "node_rank=2: must be in"),
        (dict(nnodes=0), "nnodes=0"),
        (dict(dist_heartbeat_s=0), "dist_heartbeat_s=0"),
        (dict(nnodes=2, tp_size=2, dist_init_addr="h:1", dp_size=2), "dp_size=2 with nnodes=2"),
        (dict(nnodes=2, tp_size=2, dist_init_addr="h:1", enable_lora=True), "enable_lora cannot be combined with nnodes > 1"),
    ],
)
def test_bad_many_hosts_options(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerArgs(**kwargs)


def test_platform_defaults_fill_only_what_was_not_given():
    """prefill_step_cost None: the platform's (CPU measured, elsewhere never cut); given: kept."""
    assert ServerArgs().for_platform("cpu").prefill_step_cost == 32
    assert ServerArgs().for_platform("tpu").prefill_step_cost == 0
    assert ServerArgs().for_platform("cuda").prefill_step_cost == 0
    assert ServerArgs(prefill_step_cost=0).for_platform("cpu").prefill_step_cost == 0
    assert ServerArgs(prefill_step_cost=64).for_platform("tpu").prefill_step_cost == 64
    assert parse(["--prefill-step-cost", "8"]).prefill_step_cost == 8


def test_max_extend_tokens_holds_a_prefill_budget_or_a_verify_step():
    assert ServerArgs().max_extend_tokens == 2048 + 16 * 64
    assert ServerArgs(max_prefill_tokens=16, extend_block=2, max_running_requests=64, speculative_algorithm="ngram",
                      speculative_num_draft_tokens=4).max_extend_tokens == 5 * 64 + 2  # fmt: skip
