"""Shared fixtures: tiny checkpoints made once per test session (offline, seeded)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """RINGSERVE_FAST=1 skips the tests marked slow (CI runs them all); the tests marked sweep
    (the same check over every other family, topology or split, CI running one of each) run
    with RINGSERVE_SWEEP=1."""
    fast, sweep = os.environ.get("RINGSERVE_FAST") == "1", os.environ.get("RINGSERVE_SWEEP") == "1"
    for item in items:
        if fast and item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.skip(reason="slow (RINGSERVE_FAST=1)"))
        if not sweep and item.get_closest_marker("sweep") is not None:
            item.add_marker(pytest.mark.skip(reason="a sweep case: RINGSERVE_SWEEP=1 runs it (CI runs one of its kind)"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(family) -> path of a tiny random checkpoint of that family (seed 0)."""
    from ringserve.model.checkpoints.tiny import make_tiny_model

    made: dict[str, object] = {}

    def get(family: str = "llama"):
        if family not in made:
            made[family] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, seed=0)
        return made[family]

    return get


@pytest.fixture(scope="session", autouse=True)
def xla_cache(tmp_path_factory):
    """One persistent XLA cache for the run: engines and executors with equal shapes compile once."""
    from ringserve.model.runtime.programs import enable_compilation_cache

    return enable_compilation_cache(
        os.environ.get("RINGSERVE_TEST_XLA_CACHE") or tmp_path_factory.mktemp("xla")
    )


@pytest.fixture(scope="session")
def shared_engine(tmp_path_factory):
    """One tiny-model engine (page 16, small shapes) for the API, seed-000 and front-door tests;
    a test that changes its weights or state restores them (the `engine` fixtures check). Its JSON
    outputs are compact: the random model would otherwise fill them with whitespace."""
    from ringserve import Engine
    from ringserve.model.checkpoints.tiny import make_tiny_model
    from tests.engine.conftest import SMALL

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-shared"), "llama", seed=0)
    e = Engine(str(model), page_size=16, constrained_json_disable_any_whitespace=True, **SMALL)
    yield e
    e.shutdown()
