"""The RL loop, whole: generate → pause(retract) → update weights → flush → continue, three
times, with weights from disk and from tensors; after each update greedy and seeded outputs
equal a fresh Engine's on that checkpoint, weight_version is reported, nothing leaks and nothing
recompiles. Refusals leave the old weights serving. Device memory is released and resumed."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from tests.engine.conftest import SMALL, assert_no_leak, in_background, random_prompts

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
SEEDED = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": 12, "sampling_seed": 77, "n": 4}
PROMPTS = random_prompts(3, seed=51, lo=8, hi=30)


def outputs(engine) -> tuple[list, list]:
    greedy = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    seeded = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS[0], sampling_params=SEEDED)]
    return greedy, seeded


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from ringserve.model.checkpoints.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("rl")
    return [make_tiny_model(root / f"s{seed}", "llama", seed=seed) for seed in range(4)]


@pytest.fixture(scope="module")
def fresh(checkpoints):
    """Outputs of a fresh Engine on each checkpoint (the references)."""
    from ringserve import Engine

    refs = {}
    for ck in checkpoints:
        with Engine(str(ck), page_size=16, precompile=False, **SMALL) as e:
            refs[str(ck)] = outputs(e)
    return refs


@pytest.fixture(scope="module")
def rl_engine(checkpoints):
    from ringserve import Engine

    e = Engine(str(checkpoints[0]), page_size=16, **SMALL)
    yield e
    e.shutdown()


@pytest.fixture
def engine(rl_engine):
    yield rl_engine
    rl_engine.continue_generation()
    assert_no_leak(rl_engine)


def rl_iteration(engine, update) -> dict:
    t, box = in_background(engine, PROMPTS, 200, sampling_seed=5)  # a rollout is running
    assert engine.pause_generation("retract")["success"]
    r = update()
    assert r["success"], r
    assert engine.flush_cache()["success"]
    assert engine.continue_generation()["success"]
    t.join(60)
    assert "err" not in box  # the retracted rollout finished (on the new weights)
    return r


def test_rl_loop_with_weights_from_disk(engine, checkpoints, fresh):
    assert outputs(engine) == fresh[str(checkpoints[0])]
    traces = engine.wait_compiled()["runner_trace_count"]  # every program compiled before the updates
    for i, ck in enumerate(checkpoints[1:], start=1):
        r = rl_iteration(engine, lambda ck=ck: engine.update_weights_from_disk(str(ck)))
        assert r["weight_version"] == str(i)
        assert outputs(engine) == fresh[str(ck)], f"after update {i}"
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert out["meta_info"]["weight_version"] == str(i)
        assert engine.get_server_info()["weight_version"] == str(i)
        assert engine.get_server_info()["runner_trace_count"] == traces  # nothing recompiled
    r = rl_iteration(engine, lambda: engine.update_weights_from_disk(str(checkpoints[0]), weight_version="back-to-0"))
    assert r["weight_version"] == "back-to-0" and outputs(engine) == fresh[str(checkpoints[0])]


def _tensors(ck) -> dict[str, np.ndarray]:
    from ringserve.model.checkpoints.load import load_checkpoint

    return {k: np.array(v) for k, v in load_checkpoint(ck)[1].items()}


def test_rl_loop_with_weights_from_tensors_subsets_and_chunks(engine, checkpoints, fresh, tmp_path):
    from safetensors.numpy import save_file

    for ck in checkpoints[1:]:
        new = _tensors(ck)
        layers = {k: v for k, v in new.items() if ".layers." in k}  # a subset: every layer weight
        rest = {k: v for k, v in new.items() if ".layers." not in k}
        rl_iteration(engine, lambda layers=layers: engine.update_weights_from_tensor(layers, bucket_bytes=1 << 20))
        rl_iteration(engine, lambda rest=rest: engine.update_weights_from_tensor(list(rest.items())))
        assert outputs(engine) == fresh[str(ck)]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"rs-{os.getpid()}-") and "-push" in f]
    # a true subset (one layer from s1 over s3) equals a fresh engine on that mixed checkpoint
    mixed = _tensors(checkpoints[3]) | {k: v for k, v in _tensors(checkpoints[1]).items() if ".layers.1." in k}
    d = tmp_path / "mixed"
    shutil.copytree(checkpoints[3], d)
    save_file(mixed, str(d / "model.safetensors"))
    from ringserve import Engine

    with Engine(str(d), page_size=16, precompile=False, **SMALL) as e:
        want = outputs(e)
    r = engine.update_weights_from_tensor({k: v for k, v in mixed.items() if ".layers.1." in k}, weight_version="mix")
    assert r == {"success": True, "message": "updated 9 tensors", "weight_version": "mix",
                 "bytes": sum(v.nbytes for k, v in mixed.items() if ".layers.1." in k)}
    assert engine.flush_cache()["success"] and outputs(engine) == want
    got = engine.get_weights_by_name("model.layers.1.mlp.up_proj.weight", truncate_size=3)
    np.testing.assert_array_equal(np.asarray(got, np.float32), mixed["model.layers.1.mlp.up_proj.weight"][:3])
    assert engine.update_weights_from_disk(str(checkpoints[0]))["success"]


def test_refusals_leave_the_old_weights_serving(engine, checkpoints, tmp_path):
    from safetensors.numpy import save_file

    from ringserve.model.checkpoints.tiny import make_tiny_model

    before = outputs(engine)
    version = engine.get_server_info()["weight_version"]

    def refused(r: dict, *words: str) -> None:
        assert r["success"] is False, r
        for w in words:
            assert w in r["message"], (w, r["message"])
        assert outputs(engine) == before and engine.get_server_info()["weight_version"] == version

    t, box = in_background(engine, PROMPTS, 100)  # requests run, the engine is not paused
    refused(engine.update_weights_from_disk(str(checkpoints[1])), "refused", "running", "pause_generation")
    t.join(60)
    base = _tensors(checkpoints[1])
    missing = tmp_path / "missing"
    shutil.copytree(checkpoints[1], missing)
    save_file({k: v for k, v in base.items() if k != "model.layers.2.mlp.down_proj.weight"}, str(missing / "model.safetensors"))
    refused(engine.update_weights_from_disk(str(missing)), "model.layers.2.mlp.down_proj.weight")
    bad = tmp_path / "shape"
    shutil.copytree(checkpoints[1], bad)
    save_file({**base, "model.layers.0.self_attn.k_proj.weight": np.zeros((64, 256), np.float32)}, str(bad / "model.safetensors"))
    refused(engine.update_weights_from_disk(str(bad)), "model.layers.0.self_attn.k_proj.weight", "(64, 256)")
    other = make_tiny_model(tmp_path / "qwen2", "qwen2", seed=1)
    refused(engine.update_weights_from_disk(str(other)), "another architecture", "family 'qwen2' != 'llama'")
    deeper = make_tiny_model(tmp_path / "deep", "llama", seed=1, num_hidden_layers=6)
    refused(engine.update_weights_from_disk(str(deeper)), "num_layers 6 != 4")
    refused(engine.update_weights_from_disk(str(tmp_path / "nowhere")), "no such directory")
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.weight' has dtype int32"):
        engine.update_weights_from_tensor({"model.layers.0.mlp.up_proj.weight": np.zeros((640, 256), np.int32)})
    refused(engine.update_weights_from_tensor({"model.layers.9.mlp.up_proj.weight": np.zeros((640, 256), np.float32)}),
            "model.layers.9.mlp.up_proj.weight", "not a weight")  # fmt: skip
    with pytest.raises(ValueError, match="weight_version"):
        engine.update_weights_from_disk(str(checkpoints[1]), weight_version="")
    with pytest.raises(ValueError, match="no weight named 'lm_head.weight'"):
        engine.get_weights_by_name("lm_head.weight")  # tied embeddings: there is none


def test_release_and_resume_memory(engine):
    before = outputs(engine)
    t, box = in_background(engine, PROMPTS, 100)
    r = engine.release_memory_occupation()
    assert not r["success"] and "pause_generation" in r["message"]
    assert engine.pause_generation("in_place")["success"]
    r = engine.release_memory_occupation(["kv_cache"])
    assert not r["success"] and "hold KV" in r["message"]  # in-place requests still hold it
    assert engine.pause_generation("retract")["success"]
    assert engine.release_memory_occupation()["success"]
    assert engine.get_server_info()["memory_released"] == ["kv_cache", "weights"]
    engine.continue_generation()  # not paused any more, but nothing runs without memory
    assert engine.get_load()["num_running_reqs"] == 0 and t.is_alive()
    assert engine.resume_memory_occupation()["success"]
    t.join(60)
    assert "err" not in box and outputs(engine) == before
    with pytest.raises(ValueError, match="tags"):
        engine.release_memory_occupation(["gpu"])


def test_deltas_equal_the_full_update_on_their_base_and_are_refused_on_another(engine, checkpoints):
    """Four deltas in a row, each made against the version before it (a subset; mode "add";
    Rows of tensors; "add" of Rows and a whole tensor): each serves what the equivalent full
    update serves (greedy and seeded tokens, the weights read back). A delta on another base, or
    a bad mode, changes nothing."""
    from ringserve import Rows

    base, target = _tensors(checkpoints[0]), _tensors(checkpoints[2])
    E, Q, U = "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"
    N = "model.layers.2.input_layernorm.weight"
    t = min(PROMPTS[0])  # a token every run reads: its embedding row changes
    f32 = np.float32
    deltas = [  # (mode, named_tensors, what it makes of the served tensors)
        ("replace", {U: target[U], N: target[N]}, lambda w: w | {U: target[U], N: target[N]}),
        ("add", {Q: target[Q] - base[Q]}, lambda w: w | {Q: w[Q] + (target[Q] - base[Q])}),
        ("replace", {E: [Rows(t, target[E][t : t + 3]), Rows(1500, target[E][1500:1600])], U: Rows(0, base[U][:320])},
         lambda w: w | {E: np.concatenate([w[E][:t], target[E][t : t + 3], w[E][t + 3 : 1500], target[E][1500:1600],
                                            w[E][1600:]]), U: np.concatenate([base[U][:320], w[U][320:]])}),
        ("add", {E: Rows(t, np.full((1, 256), 0.25, f32)), N: np.full(256, -0.5, f32)},
         lambda w: w | {E: np.concatenate([w[E][:t], w[E][t : t + 1] + f32(0.25), w[E][t + 1 :]]), N: w[N] - f32(0.5)}),
    ]  # fmt: skip
    assert engine.update_weights_from_disk(str(checkpoints[0]), weight_version="d0")["success"]  # (idle: no pause needed)
    served, seen = dict(base), [outputs(engine)]
    for i, (mode, named, apply) in enumerate(deltas, start=1):
        r = engine.update_weights_from_tensor(named, weight_version=f"d{i}", mode=mode, base_weight_version=f"d{i - 1}")
        sent = sum(v.array.nbytes if isinstance(v, Rows) else v.nbytes for vs in named.values()
                   for v in (vs if isinstance(vs, list) else [vs]))  # fmt: skip
        assert r == {"success": True, "message": f"updated {len(named)} tensors", "weight_version": f"d{i}", "bytes": sent}
        served = apply(served)
        got = outputs(engine)
        assert got != seen[-1], f"delta {i} changed no token"  # (so the comparison below can fail)
        seen.append(got)
        read = {k: engine.get_weights_by_name(k, truncate_size=4096) for k in (E, Q, U, N)}
        # the equivalent full update (every tensor, made from the served values) serves the same
        assert engine.update_weights_from_tensor(served, weight_version=f"d{i}")["success"]
        assert engine.flush_cache()["success"]
        assert outputs(engine) == got, f"delta {i}"
        for k, rows in read.items():
            assert engine.get_weights_by_name(k, truncate_size=4096) == rows, (i, k)
            np.testing.assert_array_equal(np.asarray(rows, f32), served[k])
    # against another base: refused before anything is staged, nothing changes
    before = engine.get_weights_by_name(N, truncate_size=256)
    r = engine.update_weights_from_tensor({N: np.ones(256, f32)}, mode="add", base_weight_version="d3")
    assert r["success"] is False and r["weight_version"] == "d4", r
    assert "base_weight_version='d3' but the engine serves 'd4'" in r["message"], r
    r = engine.update_weights_from_disk(str(checkpoints[1]), base_weight_version="d0")
    assert r["success"] is False and "base_weight_version='d0' but the engine serves 'd4'" in r["message"], r
    with pytest.raises(ValueError, match=r"mode='mul' must be one of \['replace', 'add'\]"):
        engine.update_weights_from_tensor({N: np.ones(256, f32)}, mode="mul")
    with pytest.raises(ValueError, match="base_weight_version=''"):
        engine.update_weights_from_tensor({N: np.ones(256, f32)}, base_weight_version="")
    r = engine.update_weights_from_tensor({E: [Rows(0, np.ones((4, 256), f32)), Rows(3, np.ones((1, 256), f32))]})
    assert r["success"] is False and "'model.embed_tokens.weight': rows [0, 4) and [3, 4) overlap" in r["message"], r
    assert engine.get_server_info()["weight_version"] == "d4" and engine.get_weights_by_name(N, truncate_size=256) == before
    assert engine.flush_cache()["success"] and outputs(engine) == seen[-1]
    assert engine.update_weights_from_disk(str(checkpoints[0]))["success"]


def test_the_same_verbs_over_http_and_the_client(engine, checkpoints):
    import httpx

    from ringserve import Client, Servers

    with Servers(engine, port=0) as s:
        assert engine.pause_generation("retract")["success"]
        r = httpx.post(s.url + "/update_weights_from_disk", json={"model_path": str(checkpoints[2]), "weight_version": "h"})
        assert r.status_code == 200 and r.json()["weight_version"] == "h"
        assert httpx.get(s.url + "/get_weight_version").json() == {"weight_version": "h"}
        r = httpx.post(s.url + "/update_weights_from_disk", json={"model_path": "/no/such/dir"})
        assert r.status_code == 400 and r.json()["success"] is False
        w = httpx.post(s.url + "/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 4}).json()
        assert len(w) == 4
        assert httpx.post(s.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}).json()["success"]
        assert httpx.post(s.url + "/resume_memory_occupation", json={}).json()["success"]
        with Client(s.socket_path) as c:
            assert c.update_weights_from_disk(str(checkpoints[0]))["success"]
            assert json.dumps(c.get_weights_by_name("model.norm.weight", 2))
        engine.flush_cache()
        engine.continue_generation()
