"""The front doors of one Engine: its IPC socket and HTTP server, on the frontend loop.

    with Engine("tiny") as engine, Servers(engine, host="127.0.0.1", port=0) as s:
        Client(s.socket_path).generate("hi")   # or http://127.0.0.1:<s.port>/v1/...

`stop()` is the graceful end `ringserve serve` runs on SIGINT / SIGTERM: stop accepting, refuse
new calls on open connections, abort what runs (callers get their partial output with finish
reason abort), give the answers a moment to leave, then close every connection and remove the
socket file.

The socket file (and the private directory made for it) goes however things end: `stop()` after
an actor died (the engine refuses calls, the servers still close), `start()` failing half way
(the port taken), or the engine shut down under servers never stopped (it stops them first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from ringserve.actors.frontend.engine import Engine
from ringserve.actors.frontend.http_server import build_app
from ringserve.actors.frontend.ipc_server import IPCServer
from ringserve.actors.frontend.verbs import HTTP_VERBS, verb_table

log = logging.getLogger("ringserve.server")

STOP_TIMEOUT_S = 15.0  # closing the connections and the HTTP server, past the drain


async def _serve(server: Any, listener: Any = None) -> None:
    """uvicorn's serve() (on `listener`, a socket bound already, if given); it raises SystemExit
    when it cannot bind, which would end the frontend's loop thread: an OSError instead."""
    try:
        await server.serve(sockets=[listener] if listener is not None else None)
    except SystemExit as e:
        raise OSError(f"the HTTP server exited (status {e.code})") from None


class Servers:
    def __init__(self, engine: Engine, *, socket: str | None = None, ipc: bool = True, http: bool = True,
                 host: str | None = None, port: int | None = None, api_key: str | None = None,
                 listener: Any = None):  # fmt: skip
        """`listener`: HTTP's socket, bound already (`ringserve serve` binds it before the model
        loads, so a port in use is told at once); its address wins over host and port."""
        self.engine = engine
        self.listener = listener
        self.tm = tm = engine.frontend
        self.verbs = verb_table(tm)
        self.ipc = IPCServer(tm, self.verbs, socket) if ipc else None
        self.host = host if host is not None else engine.args.host
        self.port = port if port is not None else engine.args.port
        if listener is not None:
            self.host, self.port = listener.getsockname()[:2]
        self._http: Any = None
        self._http_task: asyncio.Task | None = None
        self.api_key = api_key
        self.http_enabled = http
        self.stopped = False

    @property
    def socket_path(self) -> str | None:
        return self.ipc.path if self.ipc else None

    @property
    def url(self) -> str | None:
        return f"http://{self.host}:{self.port}" if self._http is not None else None

    def start(self) -> Servers:
        self.tm.on_close.append(self.stop)  # an engine shut down first takes its servers with it
        try:
            self.tm.run_sync(self._start())
        except BaseException:  # close what did start; the engine serves on (its other servers too)
            self.stopped = True
            try:
                if self.tm.lt.usable:
                    self.tm.lt.run(self._close(), timeout=STOP_TIMEOUT_S)
            finally:
                if self.ipc is not None:
                    self.ipc.remove_files()
            raise
        return self

    async def _start(self) -> None:
        if self.ipc is not None:
            await self.ipc.start()
        if self.http_enabled:
            import uvicorn

            app = build_app(self.tm, model_name=self.engine.served_model_name, model_path=str(self.engine.model_dir),
                            api_key=self.api_key, verbs={k: self.verbs[k] for k in HTTP_VERBS})  # fmt: skip
            config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                    lifespan="off", timeout_graceful_shutdown=3)  # fmt: skip
            server = uvicorn.Server(config)
            self._http = server
            self._http_task = asyncio.create_task(_serve(server, self.listener))
            while not server.started:
                if self._http_task.done():  # e.g. the port is taken: uvicorn logged it and returned
                    exc = self._http_task.exception()
                    raise OSError(f"HTTP server on {self.host}:{self.port} did not start" + (f": {exc}" if exc else ""))
                await asyncio.sleep(0.02)
            self.port = server.servers[0].sockets[0].getsockname()[1]

    def stop(self, drain_s: float = 3.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        lt = self.tm.lt
        try:
            if lt.usable and not lt.on_loop:  # also when the engine is dead: the servers still close
                lt.run(self._stop(drain_s), timeout=drain_s + STOP_TIMEOUT_S)
        except Exception:
            log.exception("stopping the servers")
        finally:
            if self.ipc is not None:
                self.ipc.remove_files()

    async def _stop(self, drain_s: float) -> None:
        if self._http is not None:
            self._http.should_exit = True  # stops accepting; in-flight requests finish below
        self.tm.refuse_new("the server is shutting down")
        if self.tm.core.states:
            with contextlib.suppress(Exception):
                self.tm.abort_request(abort_all=True)
        deadline = time.monotonic() + drain_s
        while self.tm.core.states and time.monotonic() < deadline:  # aborted outputs on their way out
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # let the last answers reach their sockets
        await self._close()

    async def _close(self) -> None:
        if self.ipc is not None:
            await self.ipc.close()
        if self._http is not None:
            self._http.should_exit = True
        if self._http_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._http_task, 5.0)

    def __enter__(self) -> Servers:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
