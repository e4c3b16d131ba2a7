"""The engine's tokenizer, built when it is first asked for instead of during the load.

Building one is mostly Python under the GIL (a GGUF's vocabulary arrays parsed and turned into BPE
merges), so building it beside the weights slowed the executor's setup instead of hiding behind it, and
a caller that only ever sends token ids never needs it.  `get()` builds it once, even when several
threads ask at the same moment; an error building it is kept and raised, with the model named, at
every use, so a model whose tokenizer is broken still serves token ids.  A server starts the build on a
background thread right after the load (`start_background`), so the first text request rarely waits.
"""
from __future__ import annotations

import threading
from typing import Callable

from kestrel_stream.obs.load_stages import stage

STAGE = "tokenizer (built on first use)"


class LazyTokenizer:
    def __init__(self, build: Callable[[], object], source: str):
        """build: returns the text/tokenizer.Tokenizer, or None where the model carries none."""
        self._build, self.source = build, source
        self._lock = threading.Lock()
        self._done = False
        self._value = None
        self._error: Exception | None = None

    @classmethod
    def ready(cls, tokenizer) -> "LazyTokenizer":
        """One that is already built (a Tokenizer, or None for a model without one)."""
        lazy = cls(lambda: tokenizer, getattr(tokenizer, "source", ""))
        lazy._done, lazy._value = True, tokenizer
        return lazy

    @property
    def built(self) -> bool:
        """Whether get() returns (or raises) without building."""
        return self._done

    def get(self):
        """The tokenizer (or None), built here on the first call."""
        if not self._done:
            with self._lock:
                if not self._done:              # another thread may have built it while this one waited
                    self._run_build()
        if self._error is not None:
            raise self._failure() from self._error
        return self._value

    def _run_build(self) -> None:
        try:
            with stage(STAGE):
                self._value = self._build()
        except Exception as e:                  # kept: every use says why there is no tokenizer
            self._error = e
        self._done = True                       # not on KeyboardInterrupt: the next use tries again

    def _failure(self) -> Exception:
        from kestrel_stream.text.tokenizer import TokenizerError
        e = self._error
        if isinstance(e, TokenizerError):       # its message already names the file
            return TokenizerError(f"the model's tokenizer cannot be built: {e}")
        return TokenizerError(f"{self.source}: the model's tokenizer cannot be built "
                              f"({type(e).__name__}: {e}); token ids still work")

    def start_background(self) -> threading.Thread | None:
        """Build on a daemon thread now (None when it is built already); get() waits for it if asked first."""
        if self._done:
            return None
        thread = threading.Thread(target=self._build_quietly, name="kestrel-tokenizer", daemon=True)
        thread.start()
        return thread

    def _build_quietly(self) -> None:
        try:
            self.get()
        except Exception:                       # kept in self._error; raised at the first use
            pass
