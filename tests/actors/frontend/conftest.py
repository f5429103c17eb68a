"""The shared engine with its IPC socket and HTTP server for the front-door tests, and a
leak check after each test: KV books intact, every page and slot back, nothing running."""

from __future__ import annotations

import pytest

from tests.engine.conftest import assert_no_leak

API_KEY = "test-key-0123456789"


@pytest.fixture(scope="session")
def served(shared_engine):
    """(engine, servers): the shared tiny engine, its socket in a private dir, HTTP on an
    ephemeral port."""
    from ringserve import Servers

    servers = Servers(shared_engine, port=0).start()
    yield shared_engine, servers
    servers.stop()


@pytest.fixture(scope="session")
def served_with_key(served):
    """A second HTTP server with an API key, over the same engine."""
    from ringserve import Servers

    engine, _ = served
    servers = Servers(engine, ipc=False, port=0, api_key=API_KEY).start()
    yield servers
    servers.stop()


@pytest.fixture
def engine(served):
    e, _ = served
    yield e
    e.continue_generation()
    assert_no_leak(e)


@pytest.fixture
def servers(served, engine):
    return served[1]


@pytest.fixture
def client(servers):
    from ringserve import Client

    c = Client(servers.socket_path)
    yield c
    c.close()
