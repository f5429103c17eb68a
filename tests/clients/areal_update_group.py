"""AReaL's weight sync over an update group (areal 1.0.4, unmodified) against a running
`ringserve serve`: the trainer side is FSDPEngine's own `_init_weight_update_from_distributed`
and `_update_weights_from_distributed` (pause_generation, the rank-0 TCP rendezvous of
`init_custom_process_group`, the parameters broadcast bucket by bucket with async
`dist.broadcast` while /update_weights_from_distributed runs, continue_generation), the engine
side is RemoteSGLangEngine's HTTP calls. FSDPEngine is not initialized for training here (no
optimizer, no FSDP sharding on one CPU rank): the object carries what those two methods read —
the HF model whose parameters they broadcast, the rollout engine, the config's dtype and the
process's gloo group. Run in AReaL's venv by tests/clients/test_areal.py:

    python tests/clients/areal_update_group.py ADDR CASES.json

CASES.json: {"prompt": [...], "new_model": dir, "max_new": n, "name_resolve_root": dir}. Prints
JSON: the greedy tokens after the update, and the versions before and after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import types
import uuid

import torch
import torch.distributed as dist
from areal.api.alloc_mode import ModelAllocation
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.fsdp_engine import FSDPEngine
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.utils import name_resolve
from transformers import AutoModelForCausalLM


def main() -> int:
    addr, cases_path = sys.argv[1], sys.argv[2]
    cases = json.load(open(cases_path))
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=cases["name_resolve_root"]))
    rollout = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1", experiment_name="ringserve-test",
                                                       trial_name=uuid.uuid4().hex[:8], max_concurrent_rollouts=4,
                                                       request_timeout=300, setup_timeout=120))  # fmt: skip
    rollout.initialize(addr=addr)
    # the trainer's own process group (torchrun's, one rank here)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    trainer = object.__new__(FSDPEngine)  # FSDPEngine's methods on what they read of it
    trainer.rollout_engine = rollout
    trainer.logger = logging.getLogger("areal-trainer")
    trainer.model = AutoModelForCausalLM.from_pretrained(cases["new_model"], dtype=torch.float32)
    trainer.is_vision_model = False
    trainer.config = types.SimpleNamespace(use_lora=False, dtype="float32")
    trainer._initialized, trainer._cpu_group = True, dist.group.WORLD
    trainer.weight_update_group_names = []

    meta = WeightUpdateMeta.from_fsdp_xccl(ModelAllocation.from_str("sglang:d1"))
    out: dict = {"version_before": rollout.get_version()}
    trainer._init_weight_update_from_distributed(meta)
    trainer._update_weights_from_distributed(meta)
    req = ModelRequest(input_ids=list(cases["prompt"]),
                       gconfig=GenerationHyperparameters(max_new_tokens=cases["max_new"], greedy=True, ignore_eos=True))  # fmt: skip
    out["after_update"] = list(asyncio.run(rollout.agenerate(req)).output_tokens)
    out["names"] = len(list(trainer.model.named_parameters()))
    rollout.destroy()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
