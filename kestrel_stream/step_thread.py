"""One long-lived thread that runs every engine call of the daemon, off the event loop."""
from __future__ import annotations

import asyncio
import queue
import threading

import anyio


class StepThread:
    """One long-lived thread that runs every engine call, in submission order.

    Cheaper per call than ``anyio.to_thread`` (no limiter, no pool, no context
    copy): a call is one queue put, and its result comes back through
    ``call_soon_threadsafe`` on an asyncio future, a single wake-up of the loop.
    The daemon runs on anyio's asyncio backend; on another backend calls fall
    back to ``anyio.to_thread`` with a one-thread limiter."""

    def __init__(self):
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.limiter = anyio.CapacityLimiter(1)
        self.thread = None
        if self.loop is not None:
            self.thread = threading.Thread(target=self.serve, name="kestrel-step", daemon=True)
            self.thread.start()

    async def run(self, fn, *args):
        if self.thread is None:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        future = self.loop.create_future()
        self.calls.put((future, fn, args))
        return await future

    def serve(self) -> None:
        while (call := self.calls.get()) is not None:
            future, fn, args = call
            try:
                result = fn(*args)
            except BaseException as e:          # handed to the awaiting request, raised there
                self.loop.call_soon_threadsafe(settle, future, None, e)
            else:
                self.loop.call_soon_threadsafe(settle, future, result, None)

    def stop(self) -> None:
        if self.thread is not None:
            self.calls.put(None)
            self.thread.join()


def settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.cancelled():                       # its request was cancelled (shutdown, dropped client)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
