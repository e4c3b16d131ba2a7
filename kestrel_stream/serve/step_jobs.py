"""A request's way through the batcher and the engine steps: DecodeJob (one token), PrefillJob (a prompt).

A job is created by the request's handler (or the reader thread), queued in
the batcher, and run by the step thread in one step (a decode) or in chunks
over several (a prompt longer than what a step has room for); the step thread
then answers it (``send``) or wakes the handler waiting on it (``wait``).

A step gives each job its rows in one of three kinds (``take``): "token" (the
greedy next token alone, or a decode's token drawn on the device), "argmax"
(each row's argmax, int [n]) or "logits" ([n, V], or [1, V] where the step
computed last rows only).  A decode with want "sample" carries its row's
sampling state (pack_state): a step of such decodes and greedy ones draws
every token on the device; where the engine cannot, each gets its last logits
row ({"logits": [V]}, as want "last") and its handler draws on the host.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import numpy as np

from kestrel_stream.run.device.sample_state import GREEDY_STATE
from kestrel_stream.run.engine import Session
from kestrel_stream.serve.step_thread import settle

# Step thread: send (header, arrays) to the client, then call the third argument once it is all written.
SendFromStep = Callable[[dict, "dict | None", Callable[[], None]], None]


def answer(logits: np.ndarray, want: str, k: int) -> tuple[dict, dict]:
    """The response fields for logits [n, V]: all rows, the last row, its greedy token, or its top-k."""
    if want == "logits":
        return {}, {"logits": logits}
    last = logits[-1]
    if want in ("last", "sample"):
        return {}, {"logits": last}
    token = int(np.argmax(last))
    if want == "token":
        return {"token": token}, {}
    top = np.argpartition(-last, k - 1)[:k]
    top = top[np.argsort(-last[top], kind="stable")]
    return {"token": token}, {"topk_ids": top.astype(np.int32), "topk_logits": last[top]}


class StepJob:
    """What every job has: its session, what to answer, and the hand-over between threads."""
    __slots__ = ("session", "want", "k", "request_id", "send", "arrived_s", "position", "result", "error",
                 "done", "waiter")
    lock = threading.Lock()         # done and waiter of every job: held for a few bytecodes, by any thread
    op = "step"
    whole = False                   # the batcher never cuts it into chunks (scheduler/batcher.py)
    tree = None                     # the TokenTree its tokens are the nodes of (run/token_tree.py), or None

    def __init__(self, session: Session, want: str, k: int, request_id=None, send: SendFromStep | None = None):
        self.session, self.want, self.k = session, want, k
        self.request_id, self.send = request_id, send
        self.arrived_s = time.perf_counter()
        self.position = 0
        self.result: tuple | None = None        # (header fields, arrays)
        self.error: BaseException | None = None
        self.done = False
        self.waiter: asyncio.Future | None = None

    def finish(self, woken: list | None = None) -> None:
        """Any thread: the job is over (its answer written, when the step thread sends it).  woken: where a
        step's jobs collect their waiters, to wake the loop once for them all (``wake``)."""
        with self.lock:
            self.done = True
            waiter = self.waiter
        if waiter is None:                      # the loop wakes only when a coroutine waits for this job
            return
        if woken is not None:
            woken.append(waiter)
        else:
            waiter.get_loop().call_soon_threadsafe(settle, waiter, None, None)

    async def wait(self) -> None:
        with self.lock:
            if self.done:
                return
            self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter

    def draws_enough(self, final: bool) -> bool:
        """Whether the step may draw this chunk's one token on the device (a decode wanting its greedy or drawn
        token)."""
        return False

    async def result_or_raise(self) -> "StepJob":
        """This job once done (submitted or queued before); its error is raised here."""
        await self.wait()
        if self.error is not None:
            raise self.error
        return self


def wake(waiters: list[asyncio.Future]) -> None:
    """Settle the waiters of a step's jobs in one wake-up of their loop (one self-pipe write, not one each; the
    daemon has one loop, and a waiter of another is woken on its own)."""
    by_loop: dict = {}
    for waiter in waiters:
        by_loop.setdefault(waiter.get_loop(), []).append(waiter)
    for loop, theirs in by_loop.items():
        loop.call_soon_threadsafe(settle_all, theirs)


def settle_all(waiters: list[asyncio.Future]) -> None:
    for waiter in waiters:
        settle(waiter, None, None)


class DecodeJob(StepJob):
    """One decode token.  ``send`` set: the step thread answers the client itself and the handler does not
    wait; the connection waits (``wait``) before its next request.  Otherwise the handler waits and answers.
    want "sample": ``state`` holds the row's sampling state words (pack_state of unpenalized params, the
    generation's seed and the token's step)."""
    __slots__ = ("token", "state")
    op = "decode"
    tokens = 1

    def __init__(self, session: Session, token: int, want: str, k: int, request_id=None,
                 send: SendFromStep | None = None, state: np.ndarray | None = None):
        super().__init__(session, want, k, request_id, send)
        if (want == "sample") != (state is not None):
            raise ValueError(f"decode: want {want!r} with{'out' if state is None else ''} a sampling state")
        self.token, self.state = token, state

    def draws_enough(self, final: bool) -> bool:
        return self.want in ("token", "sample")

    def draw_state(self) -> np.ndarray:
        """The state words the device draws this row's token with (a greedy row: its argmax)."""
        return self.state if self.state is not None else GREEDY_STATE

    def ids(self, start: int, count: int) -> np.ndarray:
        return np.array([self.token], np.int64)

    def greedy_enough(self, final: bool) -> bool:
        return self.want == "token"

    def picks_enough(self, final: bool) -> bool:
        """Whether each row's argmax is all this chunk must give back."""
        return self.want == "token"

    def take(self, row, final: bool, kind: str) -> None:
        """row: the greedy token, its argmax [1] or logits [1, V], by `kind` (module docstring)."""
        if kind == "logits":
            self.result = answer(row, self.want, self.k)
        else:
            self.result = ({"token": int(row if kind == "token" else row[-1])}, {})

    def rewind(self) -> None:
        pass


class PrefillJob(StepJob):
    """A prompt, run in one chunk or several; its answer is the one the whole prompt would get at once.

    Only the rows the answer needs are kept: every chunk's logits for
    ``want="logits"``, otherwise the last chunk's alone.  want "sample": its first token drawn with ``state``
    (as DecodeJob's)."""
    __slots__ = ("prompt", "parts", "start_position", "cached_tokens", "state")
    op = "prefill"

    def __init__(self, session: Session, prompt: np.ndarray, want: str, k: int, state: np.ndarray | None = None):
        super().__init__(session, want, k)
        if (want == "sample") != (state is not None):
            raise ValueError(f"prefill: want {want!r} with{'out' if state is None else ''} a sampling state")
        self.state = state
        self.prompt = prompt                # int64 [n], checked by the service
        self.cached_tokens = 0              # the prompt's tokens before `prompt` taken from the prefix cache
        self.parts: list[np.ndarray] = []   # logits [count, V] of each chunk so far (want="logits")
        self.start_position = session.position

    @property
    def tokens(self) -> int:
        return len(self.prompt)

    def ids(self, start: int, count: int) -> np.ndarray:
        return self.prompt[start:start + count]

    def greedy_enough(self, final: bool) -> bool:
        """Whether the greedy token of the chunk's last row is all this chunk must give back."""
        return self.want != "logits" and (not final or self.want == "token")

    def picks_enough(self, final: bool) -> bool:
        """Never: lm_head would run on every row of the chunk for the last row's token."""
        return False

    def draws_enough(self, final: bool) -> bool:
        """An earlier chunk (whose rows nobody needs), or the last one of a greedy or drawn prompt: a step
        drawing its decodes' tokens gives it its last row's argmax or draw (draw_state)."""
        return self.want != "logits" and (not final or self.want in ("token", "sample"))

    def draw_state(self) -> np.ndarray:
        return self.state if self.state is not None else GREEDY_STATE

    def take(self, rows, final: bool, kind: str) -> None:
        """rows: logits of the chunk's rows (or its last row's), or with kind "token" the greedy next token."""
        if self.want == "logits":
            self.parts.append(rows)
        if not final:
            return
        if self.want == "logits":
            logits = self.parts[0] if len(self.parts) == 1 else np.concatenate(self.parts)
            self.parts = []
            self.result = answer(logits, "logits", self.k)
        else:
            self.result = ({"token": int(rows)}, {}) if kind == "token" else answer(rows, self.want, self.k)

    def rewind(self) -> None:
        """A later chunk failed: the session forgets the chunks that ran, as if the prompt never came."""
        session = self.session
        if not session.closed and session.position > self.start_position:
            session.position = self.start_position
            del session.tokens[self.start_position:]
