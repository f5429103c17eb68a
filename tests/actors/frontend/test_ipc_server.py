"""The IPC server's accept path, without an engine: a burst of clients all get in."""

from __future__ import annotations

import asyncio

from ringserve.actors.frontend import protocol as p
from ringserve.actors.frontend.ipc_server import IPCServer


def test_a_burst_of_a_thousand_connections_is_accepted(tmp_path):
    """Every client connects at once and talks before the server accepted it: none may see its
    connection reset (asyncio's default accept queue of 100 lost 899 of 1,000)."""

    async def main() -> list[object]:
        server = IPCServer(tm=None, verbs={}, path=str(tmp_path / "s.sock"))  # type: ignore[arg-type]
        await server.start()

        async def one() -> object:
            try:
                reader, writer = await asyncio.open_unix_connection(server.path)
                writer.write(p.frame(p.Cancel(id=1)))  # a call id nobody uses: nothing happens
                await writer.drain()
                writer.close()
                await writer.wait_closed()
                return True
            except Exception as e:  # noqa: BLE001 -- the failure under test
                return repr(e)

        try:
            return await asyncio.gather(*(one() for _ in range(1000)))
        finally:
            await server.close()

    results = asyncio.run(main())
    assert [r for r in results if r is not True] == []
