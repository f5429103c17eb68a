"""AReaL's RemoteSGLangEngine (areal 1.0.4), unmodified, against a running `ringserve serve`;
run in AReaL's venv (tools/install_clients.sh areal) by tests/clients/test_areal.py, which
starts the server and reads the JSON this prints last. Its calls are observed (each /generate's
stop reason) by wrapping the module function AReaL sends them with; nothing of AReaL changes.

    python tests/clients/areal_remote.py ADDR CASES.json

CASES.json: {"prompt": [...], "new_model": dir, "max_new": n}. Reports the tokens of:
`first` (a greedy generate with logprobs), `interrupted` (the same request paused with
/pause_generation mid-way and continued: AReaL resubmits prompt + partial tokens with the rest
of the budget), `after_update` (after update_weights_from_disk of `new_model` with
abort_all_requests), and what the server answered each /generate.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import threading
import time
import uuid

import areal.infra.remote_inf_engine as rie
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NameResolveConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.utils import name_resolve, names

calls: list[dict] = []
_send = rie.arequest_with_retry


async def observed(*args, **kwargs):
    out = await _send(*args, **kwargs)
    endpoint = kwargs.get("endpoint")
    if endpoint == "/generate" and isinstance(out, dict):
        calls.append({"prompt_len": len(kwargs["payload"]["input_ids"]), "stop": out["meta_info"]["finish_reason"]["type"],
                      "n": len(out["output_ids"])})  # fmt: skip
    return out


rie.arequest_with_retry = observed


def main() -> int:
    addr, cases_path = sys.argv[1], sys.argv[2]
    cases = json.load(open(cases_path))
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=cases["name_resolve_root"]))
    exp, trial = "ringserve-test", uuid.uuid4().hex[:8]
    engine = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1", experiment_name=exp, trial_name=trial,
                                                      max_concurrent_rollouts=4, request_timeout=120, setup_timeout=120,
                                                      pause_grace_period=0.5))  # fmt: skip
    engine.initialize(addr=addr)
    out: dict = {}

    def request(n: int) -> ModelRequest:
        return ModelRequest(input_ids=list(cases["prompt"]),
                            gconfig=GenerationHyperparameters(max_new_tokens=n, greedy=True, ignore_eos=True))  # fmt: skip

    # 1. a greedy generate with logprobs
    r = asyncio.run(engine.agenerate(request(cases["max_new"])))
    out["first"] = list(r.output_tokens)
    out["first_logprobs_ok"] = len(r.output_logprobs) == len(r.output_tokens) and all(
        math.isfinite(x) and x <= 0 for x in r.output_logprobs
    )
    out["first_stop"] = r.stop_reason
    # 2. paused mid-way (server: every request aborted; AReaL: waits while paused, then resubmits
    # prompt + what came, with the rest of the budget), continued
    n_before = len(calls)

    def interrupt():
        while len(calls) == n_before and time.time() < deadline:  # (no answer yet: it is generating)
            time.sleep(0.05)
            if time.time() > started + 0.3:
                break
        engine.pause()  # AReaL's own gate: no resubmission while paused
        engine.pause_generation()  # /pause_generation: the server aborts what runs
        time.sleep(0.5)
        engine.continue_generation()  # /continue_generation
        engine.resume()

    started = time.time()
    deadline = started + 60
    t = threading.Thread(target=interrupt)
    t.start()
    r = asyncio.run(engine.agenerate(request(cases["long_new"])))
    t.join()
    out["interrupted"] = list(r.output_tokens)
    out["interrupted_stop"] = r.stop_reason
    out["interrupted_calls"] = calls[n_before:]
    # 3. update_weights_from_disk with abort_all_requests (AReaL's trainer side: the checkpoint
    # saved, its name_resolve entry written)
    meta = WeightUpdateMeta(type="disk", path=cases["new_model"], clear_checkpoint_after_load=False)
    name_resolve.add(
        names.update_weights_from_disk(exp, trial, engine.get_version()), str(time.time()), replace=True
    )
    engine.update_weights_from_disk(meta).result(timeout=300)
    r = asyncio.run(engine.agenerate(request(cases["max_new"])))
    out["after_update"] = list(r.output_tokens)
    engine.destroy()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
