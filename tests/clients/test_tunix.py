"""Tunix's own GRPO learner drives ringserve's rollout engine (ringserve.integrations.tunix):
rollouts from ringserve, weights synced after every step and served exactly, greedy rollouts
equal to Tunix's vanilla rollout on the trained weights, per-token logprobs equal to Tunix's,
a finite loss; with a full actor and with a LoRA actor (merged into the weights served)."""

from __future__ import annotations

import pytest

from tests.clients.conftest import client_python, run_script


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tunix_grpo_with_ringserve_rollouts(tmp_path, lora):
    out = run_script(
        client_python("tunix"), "tunix_grpo.py", str(tmp_path), "--steps", "5", *(["--lora"] if lora else [])
    )
    assert out["steps"] == 5 and out["loss_finite"] and len(out["losses"]) == 5, out
    assert out["weights_changed"]
    assert (
        len(out["syncs"]) == 1 + 5 and max(out["syncs"]) == 0.0
    )  # at the start, then after every step: exact
    assert all(out["greedy_equal"]) and out["prompts_equal"], out
    assert out["logps_max_diff"] < 1e-4, out
