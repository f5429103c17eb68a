"""An asyncio loop in a daemon thread, and the bridges from it to plain threads and to other
loops. The frontend (TokenizerManager, IPC and HTTP servers) runs on one such loop; the sync
Engine and the sync Client call into theirs from any thread.

Streams cross with flow control: the producer runs at most `STREAM_AHEAD` items ahead of the
consumer, so one that lags holds up its producer (whose outputs are cumulative: core.py
`FrontendCore.chunks` then hands over the latest state) instead of piling items up between them, and
one that keeps up gets every item. They cross with their cancellation: when the consumer stops
early (break, close, an error, a cancelled task), the producing async iterator is closed on its
own loop, so its `finally` runs there (e.g. aborting the requests it was streaming).

A loop thread is a daemon: at interpreter exit it is frozen wherever it is, so nothing may wait
on it then (`LoopThread.usable`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class LoopClosed(RuntimeError):
    pass


class LoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self.closed = False

    @property
    def usable(self) -> bool:
        """Whether a coroutine submitted now will run: the loop is up and the interpreter is not
        finalizing (daemon threads stop for good then)."""
        return not self.closed and self.loop.is_running() and not sys.is_finalizing()

    @property
    def on_loop(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine on the loop from any thread."""
        if self.closed or self.loop.is_closed():
            coro.close()
            raise LoopClosed("the event loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for it (from a thread that is not the loop's).
        TimeoutError after `timeout` seconds (the coroutine is cancelled)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()  # KeyboardInterrupt or a timeout while waiting: stop the coroutine too
            raise

    def stop(self, timeout: float = 2.0) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.on_loop and timeout > 0 and not sys.is_finalizing():
            self.thread.join(timeout)


STREAM_AHEAD = 16  # items a stream's producer may run ahead of its consumer


def iterate_in_thread(lt: LoopThread, make: Callable[[], AsyncIterator[T]], ahead: int = STREAM_AHEAD) -> Iterator[T]:
    """A plain iterator over the async iterator `make()` running on `lt`'s loop."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    credits = asyncio.Semaphore(ahead)
    task = lt.submit(_pump(make, q.put, credits))
    try:
        while not _ended(item := q.get()):
            _give(lt, credits)
            yield item
    finally:
        task.cancel()


async def iterate_across(lt: LoopThread, make: Callable[[], AsyncIterator[T]],
                         ahead: int = STREAM_AHEAD) -> AsyncIterator[T]:  # fmt: skip
    """An async iterator on the caller's loop over `make()` running on `lt`'s loop."""
    q: asyncio.Queue = asyncio.Queue()
    here = asyncio.get_running_loop()
    credits = asyncio.Semaphore(ahead)

    def put(item: Any) -> None:
        here.call_soon_threadsafe(q.put_nowait, item)

    task = lt.submit(_pump(make, put, credits))
    try:
        while not _ended(item := await q.get()):
            _give(lt, credits)
            yield item
    finally:
        task.cancel()


def _give(lt: LoopThread, credits: asyncio.Semaphore) -> None:
    """One credit back to the producer (an item was taken)."""
    with contextlib.suppress(RuntimeError):  # the loop is gone: nothing is produced any more
        lt.loop.call_soon_threadsafe(credits.release)


_END = object()


def _ended(item: Any) -> bool:
    """Whether the pumped stream ended; re-raises the error it ended with."""
    if isinstance(item, _Raised):
        raise item.error
    return item is _END


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


async def _pump(make: Callable[[], AsyncIterator[T]], put: Callable[[Any], None], credits: asyncio.Semaphore) -> None:
    """Hands `make()`'s items to `put` on the loop, each once a credit is free (the consumer
    returns one per item it takes): at most `ahead` items wait between the two."""
    agen = make()
    try:
        while True:
            await credits.acquire()
            try:
                item = await agen.__anext__()
            except StopAsyncIteration:
                break
            put(item)
        put(_END)
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        put(_Raised(e))
    finally:
        aclose = getattr(agen, "aclose", None)
        if aclose is not None:
            await aclose()
