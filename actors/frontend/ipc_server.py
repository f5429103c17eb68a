"""The IPC socket server: a Unix domain socket on the frontend loop, speaking protocol.py.

Where: `--socket PATH`, or `engine.sock` in a private directory made for it (mode 0700) under
$XDG_RUNTIME_DIR or the temp dir. The socket is bound inside a directory only its owner can
enter and then set to 0600, so no other user can ever connect. Closing removes the socket file
(and the directory it made).

One task per connection reads frames; every call runs as its own task, so a slow stream never
holds up another call. A frame whose announced length passes the limit, or whose body is not
one of the client union's structs, is answered with a `Failed` (id 0) and the connection is
closed (the stream cannot be resynchronised); a frame nested deeper than the decoder goes is
answered `Failed` with its call's id and the connection goes on. A connection that closes,
cleanly or not, cancels its calls: their requests are aborted and their KV freed, like a
caller that leaves an Engine stream.

Back-pressure: a connection has at most `max_calls` calls in flight, and no new frame is read
from it while its replies wait for it to read them (the socket's buffer is full). A client that
sends and never reads so costs the server a bounded amount (its calls' replies), and the
kernel's socket buffer then stops the client; one that reads again is read again. A stream's
chunks are the latest state of its requests when the socket takes the next one (core.py
`FrontendCore.chunks`), so a reader that lags costs one chunk, not one per output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import shutil
import socket
import tempfile
from typing import Any

import msgspec

from ringserve.actors.frontend import protocol as p
from ringserve.actors.frontend.actor import TokenizerManager
from ringserve.actors.frontend.errors import EngineDead
from ringserve.actors.frontend.limits import too_deep
from ringserve.actors.frontend.verbs import Verb, call_verb
from ringserve.actors.frontend.weight_buckets import MAX_SLOTS

log = logging.getLogger("ringserve.ipc")

ACCEPT_BACKLOG = 4096  # connections waiting to be accepted (the kernel caps it at net.core.somaxconn)
MAX_CALLS_PER_CONNECTION = 1024  # calls in flight on one connection before it is no longer read
HANGUP_POLL_S = 0.5  # how often a connection that is not read is checked for a client that left


def private_socket_path() -> tuple[str, str]:
    """(socket path, the 0700 directory made for it)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base) or not os.access(base, os.W_OK):
        base = tempfile.gettempdir()
    d = tempfile.mkdtemp(prefix="ringserve-", dir=base)  # mkdtemp makes it 0700
    return os.path.join(d, "engine.sock"), d


class IPCServer:
    def __init__(self, tm: TokenizerManager, verbs: dict[str, Verb], path: str | None = None,
                 max_frame: int = p.DEFAULT_MAX_FRAME, max_calls: int = MAX_CALLS_PER_CONNECTION):  # fmt: skip
        self.tm = tm
        self.verbs = verbs
        self.max_frame = max_frame
        self.max_calls = max_calls
        self._made_dir: str | None = None
        if path is None:
            path, self._made_dir = private_socket_path()
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._bound = False  # the socket file at `path` is ours
        self._conns: set[_Connection] = set()

    async def start(self) -> str:
        if os.path.exists(self.path):
            if _listening(self.path):
                raise ValueError(f"socket={self.path!r}: another server is listening there")
            os.unlink(self.path)  # a stale socket file left by a killed server
        # a deep accept queue: a burst of clients past the default 100 would see their connection
        # reset while it waits to be accepted (1,000 at once: 899 lost with the default)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path, limit=1 << 16, backlog=ACCEPT_BACKLOG)
        self._bound = True
        os.chmod(self.path, 0o600)
        return self.path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(self, reader, writer)
        self._conns.add(conn)
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)

    async def close(self) -> None:
        """Stop accepting, drop every connection (their calls are cancelled), remove the file."""
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
        self.remove_files()

    def remove_files(self) -> None:
        """Remove the socket file and the directory made for it (any thread, any time, again)."""
        if self._bound:  # never bound: the path may be another server's (a refused second server)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._made_dir is not None:
            shutil.rmtree(self._made_dir, ignore_errors=True)

    @property
    def num_connections(self) -> int:
        return len(self._conns)


def _hung_up(sock: Any) -> bool:
    """Whether the peer closed its end (unread data may still wait in the socket)."""
    if sock is None:
        return True
    poll = select.poll()
    poll.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poll.poll(0))


def _listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class _Connection:
    def __init__(self, server: IPCServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server = server
        self.tm = server.tm
        self.reader, self.writer = reader, writer
        self.calls: dict[int, asyncio.Task] = {}
        self.pushes: dict[int, asyncio.Queue] = {}  # a weight push's frames, by call id
        self.write_lock = asyncio.Lock()
        self.room = asyncio.Event()  # set whenever a call ends or a reply leaves: read again?
        self.closed = False

    async def run(self) -> None:
        try:
            while True:
                if not await self._wait_for_room():
                    return  # the client left while its calls filled the connection
                try:
                    n = p.body_length(await self.reader.readexactly(p.HEADER.size), self.server.max_frame)
                    body = await self.reader.readexactly(n)
                    msg = p.client_decoder.decode(body)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # closed, cleanly or mid-frame
                except (p.FrameTooLarge, msgspec.DecodeError) as e:
                    text = str(e) if isinstance(e, p.FrameTooLarge) else f"malformed frame: {e}"
                    await self.send(p.Failed(0, "ValueError", text))
                    return
                except RecursionError:  # nested deeper than msgspec decodes (far past MAX_DEPTH)
                    head = p.peek(body)
                    if head is None:
                        await self.send(p.Failed(0, "ValueError", f"malformed frame: {too_deep('frame')}"))
                        return
                    await self.send(p.Failed(head[0], "ValueError", too_deep(head[1])))
                    continue
                self._dispatch(msg)
        finally:
            self.close()

    async def _wait_for_room(self) -> bool:
        """Back-pressure: read no frame while `max_calls` calls are in flight or replies wait in
        a full socket buffer (the client is not reading them). False if the client hung up
        meanwhile (seen without reading: the socket's POLLRDHUP), so its calls are cancelled at
        once as when it hangs up on a connection that is read."""
        transport = self.writer.transport
        high = transport.get_write_buffer_limits()[1]
        while len(self.calls) >= self.server.max_calls or transport.get_write_buffer_size() > high:
            if transport.is_closing() or _hung_up(transport.get_extra_info("socket")):
                return False
            self.room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.room.wait(), HANGUP_POLL_S)
        return True

    def _dispatch(self, msg: p.ClientMsg) -> None:
        if isinstance(msg, p.PushBucket | p.PushEnd):  # a frame of a weight push in progress
            inbox = self.pushes.get(msg.id)
            if inbox is None:
                return  # the push ended (e.g. refused): the frame is moot
            if inbox.qsize() <= MAX_SLOTS:  # a client has at most `slots` buckets unacknowledged + PushEnd
                inbox.put_nowait(msg)
            elif inbox.qsize() == MAX_SLOTS + 1:  # flooding: the push ends with this (later frames dropped)
                inbox.put_nowait(ValueError(f"weight push: more than {MAX_SLOTS} buckets sent ahead of their acks"))
            return
        if isinstance(msg, p.Cancel):
            task = self.calls.get(msg.id)
            if task is not None:
                task.cancel()
            return
        if msg.id in self.calls:
            self.calls[msg.id].cancel()  # a reused id: the client gave up on the old call
        self.calls[msg.id] = asyncio.create_task(self._call(msg))

    async def _call(self, msg: p.Generate | p.Abort | p.Control | p.PushWeights) -> None:
        try:
            if isinstance(msg, p.Generate):
                await self._generate(msg)
            elif isinstance(msg, p.PushWeights):
                await self._push(msg)
            elif isinstance(msg, p.Abort):
                self.tm.abort_request(msg.rid, msg.abort_all)
                await self.send(p.Done(msg.id))
            else:
                await self.send(p.Done(msg.id, await self._control(msg)))
        except asyncio.CancelledError:
            raise
        except ConnectionError:
            pass  # the client is gone; run() cancels the rest
        except Exception as e:
            kind = "ValueError" if isinstance(e, ValueError) else "EngineDead" if isinstance(e, EngineDead) else "RuntimeError"
            if kind == "RuntimeError":
                log.exception("IPC call %s failed", type(msg).__name__)
            with contextlib.suppress(ConnectionError):
                await self.send(p.Failed(msg.id, kind, str(e)))
        finally:
            if self.calls.get(msg.id) is asyncio.current_task():
                del self.calls[msg.id]
            self.room.set()

    async def _generate(self, c: p.Generate) -> None:
        if c.args.text is None:
            specs, batched = self.tm.specs(c.args)
        else:  # tokenizing text is CPU work: off the loop, so other connections keep going
            specs, batched = await asyncio.get_running_loop().run_in_executor(None, self.tm.specs, c.args)
        if not c.args.stream:
            await self.send(p.Done(c.id, await self.tm.generate(specs, batched)))
            return
        states = await self.tm.submit_all(specs)
        stream = self.tm.stream_states(states, batched)
        try:
            await self.send(p.Started(c.id))
            async for chunk in stream:
                await self.send(p.Chunk(c.id, chunk))
            await self.send(p.Done(c.id))
        finally:
            await stream.aclose()
            self.tm.abort_unfinished(states)  # left before the stream started: abort them too

    async def _push(self, c: p.PushWeights) -> None:
        """A weight push from a process on this host (actors/frontend/weight_push.py): its frames
        go to the call's inbox; the connection closing cancels it (segments unlinked, staged
        parts dropped)."""
        self.pushes[c.id] = asyncio.Queue()
        try:
            out = await self.tm.weights.push_from_client(c, self.pushes[c.id], self.send)
        finally:
            self.pushes.pop(c.id, None)
        await self.send(p.Done(c.id, out))

    async def _control(self, c: p.Control) -> Any:
        return await call_verb(self.server.verbs, c.verb, c.kwargs)

    async def send(self, msg: msgspec.Struct) -> None:
        if self.closed:
            raise ConnectionResetError("connection closed")
        data = p.frame(msg)
        async with self.write_lock:
            self.writer.write(data)
            await self.writer.drain()
        self.room.set()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in list(self.calls.values()):
            task.cancel()  # a stream's finally aborts its requests
        self.writer.close()
