"""Session: one decode stream over an engine, with its own KV cache and position.

Every method checks its inputs (open, token ids, room, tree shape) before it touches the cache, so a bad
call raises and leaves the session as it was; the steps themselves run through the engine
(run/engine.py), which owns the executor and its lock.
"""
from __future__ import annotations

import numpy as np

from kestrel_stream.errors import CapacityError, SessionClosedError

LOGITS = ("all", "last", "argmax")      # which logits rows a prefill returns (argmax: each row's, int64)


class Session:
    """A decode stream with its own KV cache of ``max_seq_len`` positions, stepped by ``engine`` (an Engine)."""

    def __init__(self, engine, session_id: int, max_seq_len: int, kv=None):
        self.engine, self.id, self.max_seq_len = engine, session_id, max_seq_len
        self.kv = engine.executor.alloc_kv(max_seq_len) if kv is None else kv
        self.position = 0
        self.tokens: list[int] = []
        self.closed = False
        self.pending_tree = None            # (start, TokenTree) of prefill_tree until keep_branch or truncate

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed")

    def check_room(self, count: int) -> None:
        """CapacityError unless `count` more tokens fit the session's max_seq_len."""
        if self.position + count > self.max_seq_len:
            raise CapacityError(f"session {self.id}: {count} more token(s) at position {self.position} "
                                f"exceed max_seq_len={self.max_seq_len}")

    def prefill(self, ids, logits: str = "all") -> np.ndarray:
        """Append prompt tokens; logits [len(ids), vocab] float32, or with logits="last" the last
        position's only, [vocab] (lm_head runs on that row alone), or with logits="argmax" each row's
        argmax, int64 [len(ids)] (in gpu mode taken on the device: 4 bytes a row come back)."""
        if logits not in LOGITS:
            raise ValueError(f"session {self.id} prefill: logits={logits!r}; expected one of "
                             f"{', '.join(map(repr, LOGITS))}")
        self._check_open()
        arr = self.engine.check_tokens(ids, f"session {self.id} prefill")
        self.check_room(len(arr))
        out = self.engine.step([(self, arr)], logits=logits)[0]
        return out[0] if logits == "last" else out

    def prefill_tree(self, ids, parents, logits: str = "all") -> np.ndarray:
        """Append a token tree in one step: ids [n] the nodes' tokens, parents [n] each node's parent (-1 for
        node 0, the root, which follows the session's last token; run/token_tree.py).  Node i goes in slot
        position + i at position + its depth and sees the session's tokens and its own ancestors.  Returns
        every node's logits [n, vocab] (or with logits="argmax" each node's argmax, int64 [n]); then
        keep_branch keeps one path from the root and drops the rest."""
        from kestrel_stream.run.token_tree import TokenTree
        if logits not in ("all", "argmax"):
            raise ValueError(f"session {self.id} prefill_tree: logits={logits!r}; expected 'all' or 'argmax'")
        self._check_open()
        arr = self.engine.check_tokens(ids, f"session {self.id} prefill_tree")
        tree = TokenTree(parents)
        if len(tree) != len(arr):
            raise ValueError(f"session {self.id} prefill_tree: {len(arr)} tokens but {len(tree)} parents")
        if self.engine.config.sliding_window:
            raise ValueError(f"session {self.id} prefill_tree: token trees need a model without a sliding window")
        self.check_room(len(arr))
        return self.engine.step([(self, arr)], logits=logits, trees=[tree])[0]

    def keep_branch(self, nodes: list[int]) -> None:
        """After prefill_tree: keep the nodes of one path from the root (nodes[0] == 0, each the child of the
        one before) in the slots of their positions, and forget the rest of the tree."""
        self._check_open()
        if self.pending_tree is None:
            raise ValueError(f"session {self.id} keep_branch: no token tree was prefilled")
        start, tree = self.pending_tree
        nodes = [int(n) for n in nodes]
        if not nodes or nodes[0] != 0 or any(tree.parents[b] != a for a, b in zip(nodes, nodes[1:])):
            raise ValueError(f"session {self.id} keep_branch: {nodes} is not a path from the root of the tree")
        moves = [(start + node, start + j) for j, node in enumerate(nodes) if node != j]
        kept = [self.tokens[start + node] for node in nodes]
        if moves:
            with self.engine._lock:
                self.engine.executor.move_kv(self.kv, moves)
        self.truncate(start + len(nodes))
        self.tokens[start:] = kept

    def decode(self, token: int) -> np.ndarray:
        """Append one token; logits [vocab] float32."""
        self._check_open()
        arr = self.engine.check_tokens([token], f"session {self.id} decode")
        self.check_room(1)
        return self.engine.step([(self, arr)])[0][0]

    def decode_greedy(self, token: int) -> int:
        """Append one token; the greedy next token (argmax of the logits, on the device in gpu mode)."""
        self._check_open()
        arr = self.engine.check_tokens([token], f"session {self.id} decode")
        self.check_room(1)
        return int(self.engine.step([(self, arr)], greedy=True)[0])

    def decode_sample(self, token: int, params, seed: int, step: int) -> int:
        """Append one token; the next token drawn with `params` (text/sampling.py), on the device in
        gpu mode (4 bytes back), else from the logits on the host; the same draw for (seed, step)."""
        from kestrel_stream.text.sampling import sample_logits
        self._check_open()
        arr = self.engine.check_tokens([token], f"session {self.id} decode")
        self.check_room(1)
        if not params.penalized:
            from kestrel_stream.run.device.sample_state import pack_state
            with self.engine._lock:
                out = self.engine.executor.forward_sample([(self.kv, arr, self.position)], [pack_state(params, seed, step)])
            if out is not None:
                self.position += 1
                self.tokens.append(int(token))
                return int(out[0])
        return sample_logits(self.decode(token), params, seed, step, self.tokens + [int(token)])

    def reset(self) -> None:
        """Forget the sequence; the KV cache is reused from position 0."""
        self.truncate(0)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (0 <= length <= position); the next token goes at `length`."""
        self._check_open()
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 0 <= length <= self.position:
            raise CapacityError(f"session {self.id}: truncate({length!r}) needs an int in 0..{self.position} "
                                f"(the session's position)")
        length = int(length)
        with self.engine._lock:
            self.engine.executor.truncate_kv(self.kv, length)
        self.position = length
        del self.tokens[length:]
        self.pending_tree = None

    def adopt(self, kv, length: int, tokens: list[int]) -> None:
        """Start this fresh session from the first `length` positions of another cache (a prefix)."""
        assert self.position == 0 and len(tokens) == length
        engine = self.engine
        with engine._lock:
            # the fresh session's own empty cache goes first, so the fork finds its table row even when
            # every other row is taken; if the fork fails, the session gets an empty cache back
            engine.executor.free_kv(self.kv)
            try:
                mine = engine.executor.fork_kv(kv, length, self.max_seq_len)
            except Exception:
                self.kv = engine.executor.alloc_kv(self.max_seq_len)
                raise
        self.kv, self.position, self.tokens = mine, length, list(tokens)

    def fork(self) -> "Session":
        """A new session with this one's tokens and cache (shared copy-on-write where the executor
        pages its KV, copied otherwise); both continue independently."""
        self._check_open()
        return self.engine.fork_session(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.executor.free_kv(self.kv)
            self.engine.sessions.pop(self.id, None)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
