"""The data-parallel dispatcher over a fake load source (no model): each method's choice, a
burst before any load report, cache affinity that does not pin a busy group, explicit ranks,
sessions; the load board's seqlock round trip and the per-group device environments."""

from __future__ import annotations

import dataclasses

import pytest

from ringserve.actors.frontend.dispatch import Dispatcher, PrefixIndex
from ringserve.actors.transport.loads import GroupLoad


class Board:
    """What the schedulers published: settable per group; `received` follows `take`."""

    def __init__(self, n: int):
        self.loads = [GroupLoad() for _ in range(n)]

    def __call__(self) -> list[GroupLoad]:
        return list(self.loads)

    def set(self, r: int, **kw: int) -> None:
        self.loads[r] = dataclasses.replace(self.loads[r], **kw)


def route(d: Dispatcher, ids: list[int], rid: str | None = None, **kw) -> int:
    r = d.pick(ids, **kw)
    d.sent(r, ids, kw.get("session"), rid)
    return r


def test_round_robin_alternates_whatever_the_load():
    b = Board(3)
    b.set(0, running=50)
    d = Dispatcher(3, "round_robin", loads=b)
    assert [route(d, [1, 2, 3]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("method", ["total_requests", "total_tokens"])
def test_a_burst_before_any_report_spreads_evenly(method):
    b = Board(2)  # nobody has reported anything yet: every group reads 0
    d = Dispatcher(2, method, loads=b)
    ranks = [route(d, list(range(10))) for _ in range(64)]
    assert ranks.count(0) == ranks.count(1) == 32


def test_total_requests_picks_the_group_with_fewer_requests():
    b = Board(2)
    b.set(0, running=5, waiting=3)
    b.set(1, running=2)
    d = Dispatcher(2, "total_requests", loads=b)
    ranks = [route(d, [1]) for _ in range(8)]
    # group 1 holds 2: it takes requests until it also holds 8, then they alternate
    assert ranks[:6] == [1] * 6 and sorted(ranks[6:]) == [0, 1]


def test_what_a_scheduler_has_taken_off_its_ring_is_not_counted_twice():
    b = Board(2)
    d = Dispatcher(2, "total_requests", loads=b)
    for _ in range(4):
        d.sent(0, [1, 2])
    assert [ld.num_reqs for ld in d.loads()] == [4, 0]
    b.set(0, waiting=4, received=4, received_tokens=8)  # the scheduler read all four
    assert [ld.num_reqs for ld in d.loads()] == [4, 0]
    b.set(0, waiting=0, received=4, received_tokens=8)  # and finished them
    assert [ld.num_reqs for ld in d.loads()] == [0, 0]


def test_total_tokens_weighs_tokens_not_requests():
    b = Board(2)
    b.set(0, running=1, used_tokens=4000)  # one long request
    b.set(1, running=6, used_tokens=600)  # six short ones
    d = Dispatcher(2, "total_tokens", loads=b)
    assert route(d, [1] * 100) == 1
    assert Dispatcher(2, "total_requests", loads=b).pick([1] * 100) == 0


def conversation(c: int, turns: int, page: int = 16) -> list[list[int]]:
    """Turn t's prompt: the previous turn's prompt, an answer and a new question (3 pages more)."""
    ids = [1000 * c + j for j in range(4 * page)]  # a system prompt of its own
    out = []
    for t in range(turns):
        out.append(list(ids))
        ids += [1000 * c + 500 + 50 * t + j for j in range(3 * page)]
    return out


def test_cache_aware_keeps_each_conversation_on_its_group():
    b = Board(2)
    d = Dispatcher(2, "cache_aware", loads=b)
    convs = [conversation(c, 5) for c in range(8)]
    home = [route(d, convs[c][0], rid=f"{c}-0") for c in range(8)]
    assert sorted(home) == [0] * 4 + [1] * 4  # first turns spread
    assert d.work == [4 * 64, 4 * 64]  # their whole prompts are to be computed
    for t in range(1, 5):
        for c in range(8):
            d.started(f"{c}-{t - 1}")  # the previous turn answered
            assert route(d, convs[c][t], rid=f"{c}-{t}") == home[c], (c, t)
    # a burst of every conversation's next turn at once stays home as well
    for c in range(8):
        d.started(f"{c}-4")
    nxt = [conversation(c, 6)[5] for c in range(8)]
    assert [route(d, nxt[c], rid=f"{c}-5") for c in range(8)] == home


def test_cache_aware_spreads_a_group_sharing_one_prompt_when_one_group_is_busy():
    b = Board(2)
    d = Dispatcher(2, "cache_aware", loads=b)
    prompt = list(range(200))  # 12 pages and 8 tokens
    d.sent(1, list(range(5000, 5600)), rid="long")  # group 1 is busy: 600 tokens to compute
    ranks = [route(d, prompt, rid=f"s{k}") for k in range(16)]
    # group 0 takes the first (group 1 is busier than its whole prompt), then every other
    # sample costs it 8 tokens (the prefix is cached there) against 200 on group 1
    assert ranks == [0] * 16 and d.work == [200 + 15 * 8, 600]
    # a GRPO group is not pinned to a busy group: when group 0 is the busy one, they spread
    d2 = Dispatcher(2, "cache_aware", loads=Board(2))
    d2.sent(0, prompt, rid="first")  # group 0 has the prompt cached
    d2.sent(0, list(range(9000, 9800)), rid="big")  # and 800 tokens still to compute
    ranks = [route(d2, prompt, rid=f"t{k}") for k in range(16)]
    assert ranks[0] == 1 and ranks.count(1) >= 8 and d2.work[1] == 200 + (ranks.count(1) - 1) * 8


def test_cache_aware_prefers_the_group_with_the_prefix_until_it_is_busier():
    b = Board(2)
    d = Dispatcher(2, "cache_aware", loads=b)
    prefix = list(range(320))  # 20 pages
    d.sent(1, prefix, rid="a")
    d.started("a")
    assert d.pick(prefix + [7] * 16) == 1  # 16 uncached tokens there, 336 here
    d.sent(1, list(range(1000, 1400)), rid="b")
    assert d.pick(prefix + [7] * 16) == 0  # 416 there now
    d.started("b")
    assert d.pick(prefix + [7] * 16) == 1


def test_explicit_rank_and_sessions_win():
    b = Board(2)
    b.set(1, running=100)
    d = Dispatcher(2, "total_requests", loads=b)
    assert route(d, [1], explicit=1) == 1
    assert route(d, [1], session="s") == 0
    b.set(0, running=500)
    assert route(d, [1, 2], session="s") == 0  # its turns stay where its KV is
    d.session_closed("s")
    assert route(d, [1, 2], session="s") == 1


def test_the_prefix_index_matches_whole_pages_and_forgets_the_oldest():
    ix = PrefixIndex(4, capacity=3)
    ix.add(list(range(10)))  # pages [0..3] [4..7]; 2 tokens left over
    assert ix.match(list(range(12))) == 8 and ix.match([9] + list(range(1, 8))) == 0
    ix.add([50, 51, 52, 53, 54, 55, 56, 57])  # 2 more pages: the first one goes
    assert ix.match(list(range(8))) == 0 and ix.match([50, 51, 52, 53]) == 4


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="load_balance_method='fastest'"):
        Dispatcher(2, "fastest")


def test_the_load_board_round_trips_each_row():
    from ringserve.actors.transport.loads import LoadBoard

    board = LoadBoard.create(2)
    try:
        peer = LoadBoard.attach(board.name)
        peer.publish(1, GroupLoad(3, 2, 640, 8176, 96, 5, 300))
        assert board.read_all() == [GroupLoad(), GroupLoad(3, 2, 640, 8176, 96, 5, 300)]
        assert board.read(1).num_reqs == 5
        import os
        import stat

        assert stat.S_IMODE(os.stat(f"/dev/shm/{board.name.lstrip('/')}").st_mode) == 0o600
        peer.close()
    finally:
        board.close()


def test_each_group_gets_its_own_devices():
    from ringserve.actors.transport.devices import group_envs

    assert group_envs(1, 4, {}) == [{}]
    cpu = group_envs(2, 1, {"JAX_NUM_CPU_DEVICES": "2", "XLA_FLAGS": "--xla_foo=1"})
    assert [e["JAX_NUM_CPU_DEVICES"] for e in cpu] == ["1", "1"]
    assert cpu[0]["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=1"
    gpu = group_envs(2, 2, {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu] == ["0,1", "2,3"]
    tpu = group_envs(2, 4, {"JAX_PLATFORMS": "tpu", "TPU_VISIBLE_CHIPS": "0,1,2,3,4,5,6,7"})
    assert [e["TPU_VISIBLE_CHIPS"] for e in tpu] == ["0,1,2,3", "4,5,6,7"]
    assert tpu[1]["TPU_PROCESS_ADDRESSES"] == f"localhost:{tpu[1]['TPU_PROCESS_PORT']}" != tpu[0]["TPU_PROCESS_ADDRESSES"]
    with pytest.raises(ValueError, match=r"dp_size=2 x tp_size=2 needs 4 cpu devices; this host offers 2"):
        group_envs(2, 2, {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
