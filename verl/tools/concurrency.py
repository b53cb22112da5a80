"""Tool work on event loops that come and go.

The sync trainer, the pool's ``generate`` and validation each run their agent loops under a fresh
``asyncio.run``, while a tool (and the runner) lives across them. Two asyncio defaults break there:

* an ``asyncio.Semaphore`` binds to the first loop that waits on it, and a later contended ``acquire`` from
  another loop raises "bound to a different event loop": :class:`LoopSemaphore` keeps one per loop;
* ``asyncio.to_thread`` runs on the loop's default executor, whose threads ``asyncio.run`` joins before it returns
  and the interpreter joins at exit, so one hung blocking call holds the generation and then the process:
  :func:`run_in_daemon_thread` runs the call on a thread of its own that nothing waits for.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class LoopSemaphore:
    """``async with sem:`` bounds concurrency to ``value`` on each event loop (a loop's own semaphore)."""

    def __init__(self, value: int):
        self.value = int(value)
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())

    def semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._per_loop.get(loop)
        if sem is None:
            sem = self._per_loop[loop] = asyncio.Semaphore(self.value)
        return sem

    async def __aenter__(self) -> None:
        await self.semaphore().acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.semaphore().release()  # the same loop as __aenter__: one coroutine runs on one loop


async def run_in_daemon_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``await fn(*args, **kwargs)`` run on a new daemon thread. Cancelling the await (a tool's time limit)
    abandons the thread: it cannot be stopped, but neither ``asyncio.run`` nor the interpreter's exit waits for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled: nobody is waiting for this result any more
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        try:
            result, error = context.run(fn, *args, **kwargs), None
        except BaseException as e:  # handed to the awaiting coroutine, as to_thread does
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while the call ran (it was abandoned)
            pass

    threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await future
