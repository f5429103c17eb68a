"""Two processes, one jax.distributed program (model/runtime/distributed.py): the tiny model at tp=2 over
one CPU device per process gives the greedy tokens of one process at tp=1, with every weight
placed shard by shard (no process holds another's shards on device), and `all_ok` is an AND
over the processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

SCRIPT = r"""
import json, sys
rank, n, port, path, tp = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
from ringserve.model.runtime.distributed import all_ok, barrier, init_cluster
if n > 1:
    init_cluster(("127.0.0.1", port), n, rank, timeout_s=120, heartbeat_s=10, local_devices=1)
import jax
from ringserve.model.runtime.executor import ExecutorConfig, ModelExecutor
from tests.model.test_hf_parity import greedy_with_cached_prefix, prompts_with_shared_prefix
cfg = ExecutorConfig(page_size=16, num_pages=128, max_context_len=512, max_batch=8, max_extend_tokens=256, tp_size=tp,
                     precompile=False)
ex = ModelExecutor(path, cfg)
leaves = jax.tree_util.tree_leaves(ex.params)
out = {"tokens": greedy_with_cached_prefix(ex, prompts_with_shared_prefix(32, [3, 20, 50]), 32, 16),
       "processes": jax.process_count(), "mesh": [d.process_index for d in ex.mesh.devices.flat],
       "spanning": sum(not a.is_fully_addressable for a in leaves), "leaves": len(leaves),
       "sharded_local": sum(a.addressable_shards[0].data.shape != a.shape for a in leaves),
       "and_true": all_ok(True), "and_one_false": all_ok(rank != 1)}
barrier("done", 60)
print("RESULT " + json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_over_two_processes_matches_one_process(tiny_dir):
    path = str(tiny_dir("llama"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    port = free_port()
    cmds = [[sys.executable, "-c", SCRIPT, "0", "1", "0", path, "1"]]
    cmds += [[sys.executable, "-c", SCRIPT, str(k), "2", str(port), path, "2"] for k in (0, 1)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    res = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        res.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
    single, r0, r1 = res
    assert single["processes"] == 1 and r0["processes"] == r1["processes"] == 2
    assert r0["mesh"] == r1["mesh"] == [0, 1]  # one device of each process, in process order
    assert r0["tokens"] == r1["tokens"] == single["tokens"]
    assert r0["spanning"] == r0["leaves"] and r0["sharded_local"] > 0  # every weight on both; some split
    assert (single["and_true"], single["and_one_false"]) == (True, True)
    for r in (r0, r1):
        assert (r["and_true"], r["and_one_false"]) == (True, False)
