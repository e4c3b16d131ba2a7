"""StepThread's shortcut for a lone session (run_inline) as a policy of measured step time, without a daemon:
a short step runs on the thread that read its request, and after a step slower than inline_max_s the next one
goes to the step thread, until a step there is short again."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from kestrel_stream.serve.step_thread import StepThread
from scheduler.batcher import StepBatcher

INLINE_MAX_S = 0.2                  # far above a scheduling delay: the steps here are 0 s or 0.25 s long


def job(step_s: float) -> SimpleNamespace:
    return SimpleNamespace(session=SimpleNamespace(id=1), arrived_s=time.perf_counter(), tokens=1, whole=False,
                           step_s=step_s)


def test_a_step_slower_than_inline_max_sends_the_next_one_to_the_step_thread():
    ran: list[str] = []                 # the thread each step ran on

    def run_batch(chunks) -> None:
        for chunk in chunks:
            time.sleep(chunk.payload.step_s)
            ran.append(threading.current_thread().name)

    async def main() -> None:
        steps = StepThread(StepBatcher(max_batch=4, step_tokens=8, window_s=0.0), run_batch, INLINE_MAX_S)
        try:
            for step_s in (0.0, 0.25, 0.0, 0.0):
                count = len(ran)
                steps.submit(job(step_s), at_once=True)     # as the reader thread submits a lone decode
                while len(ran) == count:
                    await asyncio.sleep(0.001)
                with steps.turn:                # the step thread has timed its step and let go
                    pass
        finally:
            steps.stop()
        here = threading.current_thread().name
        # the slow second step still ran inline (the one before it was short); the third was sent on, and the
        # step thread's short step let the fourth run inline again
        assert ran == [here, here, "kestrel-step", here] and steps.inline_steps == 3
    asyncio.run(main())


def test_a_call_run_ahead_overtakes_the_steps_ready_where_a_plain_call_waits_for_them():
    """While a step runs, a decode, a call made with ``run_ahead`` and a plain call are queued in that order: once
    the step ends the ahead call runs at once, before the step that takes the decode, and the plain call after
    that step (a call never overtakes a decode queued before it; an ahead call only adds, so it may)."""
    order: list[str] = []
    in_step, release = threading.Event(), threading.Event()

    def run_batch(chunks) -> None:
        order.append("step " + ",".join(str(chunk.payload.name) for chunk in chunks))
        if chunks[0].payload.name == "first":
            in_step.set()
            assert release.wait(10)

    def decode(name: str) -> SimpleNamespace:
        return SimpleNamespace(session=SimpleNamespace(id=name), arrived_s=time.perf_counter(), tokens=1,
                               whole=False, name=name)

    async def main() -> None:
        steps = StepThread(StepBatcher(max_batch=4, step_tokens=8, window_s=0.0), run_batch, inline_max_s=0.0)
        try:
            steps.submit(decode("first"))
            await asyncio.sleep(0)                      # the loop hands the decode on
            while not in_step.is_set():
                await asyncio.sleep(0.001)
            steps.submit(decode("second"))
            ahead = asyncio.ensure_future(steps.run_ahead(order.append, "ahead call"))
            await asyncio.sleep(0.01)
            plain = asyncio.ensure_future(steps.run(order.append, "plain call"))
            await asyncio.sleep(0.05)                   # both queued behind the decode
            release.set()
            await asyncio.gather(plain, ahead)
        finally:
            steps.stop()
        assert order == ["step first", "ahead call", "step second", "plain call"], order
    asyncio.run(main())


def test_a_steps_jobs_wake_their_handlers_with_one_wake_up_of_the_loop():
    """DecodeSteps.run answers every job of a step, then settles all their waiters in one call_soon_threadsafe
    (one self-pipe write and one loop turn for the step, not one a job)."""
    import numpy as np
    from scheduler.batcher import Chunk, Pending
    from kestrel_stream.serve.decode_steps import DecodeSteps
    from kestrel_stream.serve.step_jobs import DecodeJob

    engine = SimpleNamespace(step=lambda items, greedy=False, **kw: np.array([7, 8, 9][:len(items)]))

    async def main() -> None:
        loop, wakes = asyncio.get_running_loop(), []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakes.append(callback)
            return call_soon_threadsafe(callback, *args)

        loop.call_soon_threadsafe = counted
        steps = DecodeSteps(engine, {"decode_steps": 0, "decode_step_s": 0.0},
                            StepBatcher(max_batch=4, step_tokens=8, window_s=0.0))
        jobs = [DecodeJob(SimpleNamespace(id=i, closed=False, position=3, max_seq_len=16), 1, "token", 1)
                for i in range(3)]
        waits = [asyncio.ensure_future(job.wait()) for job in jobs]
        await asyncio.sleep(0)                          # each handler waits on its job
        step = threading.Thread(target=steps.run, args=([Chunk(Pending(j.session.id, j, j.arrived_s), 0, 1)
                                                          for j in jobs],))
        step.start()
        step.join()
        await asyncio.wait_for(asyncio.gather(*waits), 5)
        assert [job.result for job in jobs] == [({"token": t}, {}) for t in (7, 8, 9)]
        assert len(wakes) == 1, wakes
    asyncio.run(main())
