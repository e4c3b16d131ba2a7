"""Which cached prompt prefixes a request may reuse: the engine's prefix cache is shared by every client unless a
request names a scope (an HTTP request's ``cache_salt``, or its API key under ``--prefix-cache-scope key``), whose
prompts are cached apart and found only by requests of the same scope.

A shared cache answers a question about other clients' prompts: a prompt
that starts like another client's computes less, which its time to first
token shows.  A scope is a cache of its own (run/prefix_cache.py's
PrefixCache), so a request can only ever reuse what its own scope stored.
The scopes and the shared cache together stay within the shared cache's
budget of positions (the least recently used scope gives way first), and at
most MAX_SCOPES scopes are kept.  Every method runs on the step thread, like
every engine call.
"""
from __future__ import annotations

import hashlib
import traceback
from collections import OrderedDict

from kestrel_stream.errors import CapacityError
from kestrel_stream.run.prefix_cache import PrefixCache

MAX_SCOPES = 16


def scope_name(kind: str, value: str) -> str:
    """A scope's key: a digest, so that no salt or key is kept as such."""
    return hashlib.sha256(f"{kind}\0{value}".encode()).hexdigest()[:32]


class PrefixScopes:
    def __init__(self, engine):
        self.engine = engine
        self.scoped: OrderedDict[str, PrefixCache] = OrderedDict()     # least recently used first
        self.retired: dict[str, int] = {}       # the counters of scopes dropped, so that the sums never go down

    def cache_for(self, scope: str | None) -> PrefixCache | None:
        """The cache a request of ``scope`` reads and fills (None: the engine caches no prefixes)."""
        shared = self.engine.prefix_cache
        if scope is None or shared is None:
            return shared
        cache = self.scoped.get(scope)
        if cache is None:
            if len(self.scoped) >= MAX_SCOPES:
                dropped = self.scoped.popitem(last=False)[1]
                dropped.clear()
                for key, value in dropped.stats.items():
                    self.retired[key] = self.retired.get(key, 0) + value
            cache = self.scoped[scope] = PrefixCache(self.engine, shared.budget_positions, shared.block_size)
        self.scoped.move_to_end(scope)
        return cache

    def adopt(self, scope: str | None, session, tokens) -> int:
        cache = self.cache_for(scope)
        return 0 if cache is None else cache.adopt(session, tokens)

    def cached_length(self, scope: str | None, tokens) -> int:
        """Positions of the prompt `tokens` a request of ``scope`` would reuse here now; no scope is made, nothing
        moves (serve/replicas.py asks it from the event loop)."""
        shared = self.engine.prefix_cache
        cache = shared if scope is None or shared is None else self.scoped.get(scope)
        return 0 if cache is None or not len(tokens) else cache.cached_length(cache.prompt_hashes(tokens))

    def store(self, scope: str | None, session, tokens) -> None:
        cache = self.cache_for(scope)
        if cache is None:
            return
        cache.store(session, tokens)
        shared = self.engine.prefix_cache
        while self.cached_positions() > shared.budget_positions and self.evict_one():
            pass

    def evict_one(self) -> bool:
        """Give back the entry the least recently used scope (then the shared cache) used least recently."""
        for cache in self.scoped.values():
            if cache.evict_oldest():
                return True
        shared = self.engine.prefix_cache
        return shared is not None and shared.evict_oldest()

    def new_session(self, max_seq_len: int | None):
        """engine.new_session, scoped entries giving their KV back where the engine has no room (the engine's
        own allocation makes room only in the shared cache)."""
        while True:
            try:
                return self.engine.new_session(max_seq_len)
            except CapacityError:
                if not any(cache.evict_oldest() for cache in self.scoped.values()):
                    raise

    def new_session_adopting(self, max_seq_len: int | None, scope: str | None, tokens) -> tuple:
        """(new_session, the positions of the prompt `tokens` it adopted from the cache): a one-choice request's
        two calls in one visit to the step thread.  Should adopting fail (a bug), the request is served without
        the cache, on a fresh session, and the error goes to stderr."""
        session = self.new_session(max_seq_len)
        try:
            return session, self.adopt(scope, session, tokens)
        except Exception:
            traceback.print_exc()
            session.close()
            return self.new_session(max_seq_len), 0

    def cached_positions(self) -> int:
        shared = self.engine.prefix_cache
        return (0 if shared is None else shared.cached_positions) + sum(
            cache.cached_positions for cache in list(self.scoped.values()))

    def stats(self) -> dict:
        """The shared cache's counters and the scopes' added up, with the positions cached in all.  Read from any
        thread: list() copies the scopes in one step."""
        shared = self.engine.prefix_cache
        if shared is None:
            return {}
        totals = dict(shared.stats)
        for stats in [self.retired] + [cache.stats for cache in list(self.scoped.values())]:
            for key, value in dict(stats).items():
                totals[key] = totals.get(key, 0) + value
        return dict(totals, cached_positions=self.cached_positions(), budget_positions=shared.budget_positions,
                    scopes=len(self.scoped))
