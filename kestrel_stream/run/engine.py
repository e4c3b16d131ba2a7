"""Engine: the public decode API over one loaded model.

The engine owns the weights and one executor; it makes sessions (run/session.py: each owns a KV cache and
its position), runs their steps through the executor one at a time, and generates text.  Every input is
validated before any state changes, so a bad token id or an over-long prompt raises and leaves the
session as it was.
"""
from __future__ import annotations

import itertools
import sys
import threading
from dataclasses import dataclass, field

import numpy as np

from kestrel_stream.obs import trace
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.obs import prof
from kestrel_stream.options import Options
from kestrel_stream.run.prefix_cache import PrefixCache, alloc_kv_making_room
from kestrel_stream.run.session import Session
from kestrel_stream.errors import CapacityError, DeviceError, InvalidTokenError
from kestrel_stream.model.weights import ModelWeights
from kestrel_stream.text.lazy_tokenizer import LazyTokenizer
from kestrel_stream.run.device_choice import MODES, gpu_status, parse_mode, resolve_device  # noqa: F401  (public here too)

DEFAULT_MAX_SEQ_LEN = 2048
WINDOW_COUNTERS = ("streamed_bytes", "window_hits", "window_misses", "copy_busy_ms", "compute_busy_ms")


KV_DTYPES = ("f16", "f32")


def make_executor(weights: ModelWeights, device: str, mode: str, max_seq_len: int,
                  max_batch: int, max_sessions: int | None, options: Options, kv_dtype: str = "f16",
                  kv_pool_bytes: int | None = None):
    if kv_dtype not in KV_DTYPES:
        raise DeviceError(f"kv_dtype {kv_dtype!r}: expected f16 (gpu mode's default) or f32 (the reference)")
    from kestrel_stream.run.step_executor import StepExecutor
    if device == "cpu":
        return StepExecutor(weights, "cpu", options=options)
    if mode in ("gpu", "offload"):      # offload: gpu mode's budget, resident / streamed / host layers
        return StepExecutor(weights, mode, max_seq_len=max_seq_len, max_batch=max_batch, max_sessions=max_sessions,
                            options=options, kv_dtype=kv_dtype, kv_pool_bytes=kv_pool_bytes)
    if options.vram_budget is not None:
        print(f"kestrel-stream: --vram-budget applies to mode gpu; mode {mode} places weights by its plan",
              file=sys.stderr)
    profile = None
    if mode == "gated":                 # the cost model needs this machine's figures: measured once, cached
        from kestrel_stream.run.calibrate import calibrate
        profile = calibrate(options=options)
    return StepExecutor(weights, mode, profile, max_seq_len=max_seq_len, max_batch=max_batch,
                        max_sessions=max_sessions, options=options)


@dataclass
class GenerateResult:
    tokens: list[int]               # generated tokens only
    prefill_s: float
    decode_s: float
    prompt_len: int
    stats: dict = field(default_factory=dict)
    text: str | None = None         # the generated text, when the model has a tokenizer
    stop_reason: str = "length"     # eos | stop | length

    @property
    def decode_tok_s(self) -> float:
        steps = max(len(self.tokens) - 1, 0)     # the first token comes from prefill
        return steps / self.decode_s if self.decode_s > 0 and steps else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_len / self.prefill_s if self.prefill_s > 0 else 0.0


class Engine:
    # generate() chains greedy steps on the device where the executor can (gpu mode): many tokens per
    # host sync; False steps one token per sync, as the session API does
    chain_greedy = True

    def __init__(self, weights: ModelWeights, device: str = "cpu", mode: str = "cpu",
                 max_seq_len: int | None = None, max_batch: int = 32, max_sessions: int | None = None,
                 vram_budget: int | None = None, options: Options | None = None, tokenizer=None,
                 kv_dtype: str = "f16", kv_pool_bytes: int | None = None):
        # options: the KESTREL_* settings, read here unless ks.load (or the CLI) already did
        options = Options.from_env() if options is None else options
        if vram_budget is not None:
            options = options.with_(vram_budget=vram_budget)
        self.options = options
        if options.prof:
            prof.enable()
        self.weights = weights
        self.tokenizer = tokenizer          # a Tokenizer, None (token ids only) or a LazyTokenizer (ks.load's)
        self.config: ModelConfig = weights.config
        self.device, self.mode = device, mode
        context = self.config.max_position_embeddings
        if max_seq_len is not None and not 1 <= max_seq_len <= context:    # before any KV cache is sized by it
            raise CapacityError(f"max_seq_len={max_seq_len} is outside 1..{context} (the model's "
                                f"max_position_embeddings)")
        self.max_seq_len = max_seq_len or min(DEFAULT_MAX_SEQ_LEN, context)
        self.max_batch = max_batch
        # max_sessions: gpu mode's block-table rows (default 256), the split modes' reserved KV caches
        # (default 2 x max_batch)
        # kv_dtype: gpu mode's KV pool (f16, or f32 as the reference); the CPU engine keeps float32
        # kv_pool_bytes: gpu mode's KV pool, that size (a draft model's); None: what the budget leaves
        self.executor = make_executor(weights, device, mode, self.max_seq_len, max_batch, max_sessions, options,
                                      kv_dtype, kv_pool_bytes)
        self.weights = self.executor.weights        # the CPU engine's holds its repacked projections alone
        # the ids of new sessions; the daemon's replicas share one counter, so that an id names one session
        self.session_ids = itertools.count(1)
        self._lock = threading.Lock()       # one step at a time through the executor
        self.sessions: dict[int, Session] = {}
        self.prefix_cache = None            # a PrefixCache (prefix_cache.py) where enable_prefix_cache asked
        self.speculation = None             # a spec.Speculation (ks.load's draft= or spec="lookup"): generate's draft
        recorder = trace.start_for_process(options.trace_path)   # KESTREL_TRACE, or a trace the CLI began
        if recorder is not None:
            recorder.metadata.update(device=device, mode=mode, layers=self.config.num_hidden_layers)

    @property
    def tokenizer(self):
        """text/tokenizer.Tokenizer, or None where the model has none (token ids only).  ks.load's is built
        here on first use (text/lazy_tokenizer.py); a tokenizer that cannot be built raises TokenizerError."""
        return self._tokenizer.get()

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self._tokenizer = value if isinstance(value, LazyTokenizer) else LazyTokenizer.ready(value)

    @property
    def tokenizer_built(self) -> bool:
        """Whether reading `tokenizer` returns at once (it was built, or its build failed)."""
        return self._tokenizer.built

    def build_tokenizer_in_background(self) -> None:
        """Start building the tokenizer on a thread now (servers, right after the load), so the first
        text request rarely waits for it."""
        self._tokenizer.start_background()

    def enable_prefix_cache(self, budget_positions: int, block_size: int = 16):
        """Reuse cached prompt prefixes across sessions (PrefixCache.prefill_last), within
        `budget_positions` cached positions; 0 turns it off."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.prefix_cache = PrefixCache(self, budget_positions, block_size) if budget_positions else None
        return self.prefix_cache

    def plan_summary(self) -> str:
        """One line on how a decode step runs here (the daemon logs it)."""
        plan = self.executor.plan(1)
        counters = plan.counters()
        line = (f"{plan.mode}: {len(plan.segments)} segment(s), {counters['syncs_per_step']} sync(s) and "
                f"{counters['launches_per_step']} launches per decode step; GPU weights "
                f"{counters['gpu_weight_bytes'] / 1e6:.1f} MB, host weights {counters['cpu_weight_bytes'] / 1e6:.1f} MB")
        if self.executor.window_plan is not None:
            line += "; " + self.executor.window_plan.describe().splitlines()[0]
        return line

    # -- sessions ---------------------------------------------------------
    def new_session(self, max_seq_len: int | None = None) -> "Session":
        length = max_seq_len or self.max_seq_len
        if not 0 < length <= self.max_seq_len:
            raise CapacityError(f"max_seq_len={length} is outside 1..{self.max_seq_len} (the engine's limit)")
        kv = alloc_kv_making_room(self.executor, self.prefix_cache, length)
        session = Session(self, next(self.session_ids), length, kv=kv)
        self.sessions[session.id] = session
        return session

    def check_tokens(self, ids, where: str) -> np.ndarray:
        if type(ids) is list and len(ids) == 1 and type(ids[0]) is int and 0 <= ids[0] < self.config.vocab_size:
            return np.array(ids, np.int64)      # one valid token (a decode step): no array checks needed
        arr = np.asarray(ids)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.ndim != 1 or arr.size == 0:
            raise InvalidTokenError(f"{where}: expected a non-empty list of token ids, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise InvalidTokenError(f"{where}: token ids must be integers, got {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.config.vocab_size))
        if bad.size:
            raise InvalidTokenError(f"{where}: token id {int(arr[bad[0]])} at index {int(bad[0])} "
                                    f"is outside the vocabulary 0..{self.config.vocab_size - 1}")
        return arr.astype(np.int64)

    def step(self, items: list[tuple["Session", np.ndarray]], greedy: bool = False, logits: str = "all",
             trees: list | None = None, sample: list | None = None):
        """One executor step over several sessions; all inputs were validated by the caller.

        Logits [n_i, V] per session (logits="last": [1, V], each session's last row, the only rows
        lm_head computes; logits="argmax": each row's argmax, int64 [n_i], Executor.forward_argmax),
        or with greedy=True each session's greedy next token (int64 [B]): an
        executor with forward_greedy (gpu mode) then takes the argmax on the device and copies back
        4 bytes per token instead of the logits.  trees: per item a TokenTree its ids are the nodes of
        (run/token_tree.py), or None; such a session then keeps one path with keep_branch.  sample: per
        item its row's state words (device/sample_state.pack_state; greedy params give the argmax): each
        session's next token drawn on the device (int64 [B], 4 bytes a session back) where the executor can
        (Executor.forward_sample: gpu mode's steps; mode offload's decode steps with lm_head on the device),
        else each session's last logits row ([1, V] each, logits="last") for the caller to draw from."""
        batch = [(s.kv, ids, s.position) for s, ids in items]

        def run():
            if sample is not None:
                drawn = self.executor.forward_sample(batch, sample)
                return drawn if drawn is not None else self.executor.forward(batch, "last")
            if greedy:
                return self.executor.forward_greedy(batch)
            if logits == "argmax":
                return self.executor.forward_argmax(batch, trees)
            return self.executor.forward(batch, logits, trees)
        with self._lock:
            self.executor.check_kv_room(batch)
            if trace.active is None:
                out = run()
            else:
                with trace.step(sum(len(ids) for _, ids in items), sessions=len(items)):
                    out = run()
        for i, (s, ids) in enumerate(items):
            if trees is not None and trees[i] is not None:
                s.pending_tree = (s.position, trees[i])     # until keep_branch (or truncate) settles it
            s.position += len(ids)
            s.tokens.extend(np.asarray(ids).tolist())
        return out

    def decode_batch(self, pairs: list[tuple["Session", int]], greedy: bool = False) -> np.ndarray:
        """One batched decode step: logits [B, vocab], row i for pairs[i]; greedy=True: the greedy
        next token of each instead (int64 [B])."""
        if not pairs:
            raise InvalidTokenError("decode_batch: no (session, token) pairs given")
        if len({id(s) for s, _ in pairs}) != len(pairs):
            raise InvalidTokenError("decode_batch: a session appears twice in one step")
        if len(pairs) > self.max_batch:
            raise CapacityError(f"decode_batch: {len(pairs)} sessions exceed max_batch={self.max_batch}")
        items = []
        for i, (s, token) in enumerate(pairs):
            s._check_open()
            ids = self.check_tokens([token], f"decode_batch item {i} (session {s.id})")
            s.check_room(1)
            items.append((s, ids))
        if greedy:
            return self.step(items, greedy=True)
        return np.stack([out[0] for out in self.step(items)])

    def generate(self, prompt, max_new_tokens: int = 16, *, temperature: float = 0.0, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, seed: int | None = None,
                 stop: list[str] | None = None, stream: bool = False, ignore_eos: bool = False,
                 speculative: bool | None = None):
        """Generate in a fresh session from text, chat messages or token ids (text/generation.py).
        Greedy unless temperature > 0; stops at EOS/EOT, a stop string or max_new_tokens.
        stream=True: an iterator of Pieces (token, text) whose .result is set at the end.
        speculative: draft and verify (spec/) with the engine's draft; None: where the engine has one,
        False: plain decoding.  The output is the same either way (greedy) or of the same distribution."""
        from kestrel_stream.text.generation import Generation, Stream
        from kestrel_stream.text.sampling import SamplingParams
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, seed=seed)
        if speculative and self.speculation is None:
            raise ValueError("speculative=True: the engine has no draft; load it with ks.load(..., draft=PATH) "
                             "or spec=\"lookup\"")
        speculation = self.speculation if speculative is not False else None
        generation = Generation(self, prompt, max_new_tokens, params, stop, ignore_eos, speculation)
        return Stream(generation) if stream else generation.run()

    def generation_result(self, tokens, prefill_s, decode_s, prompt_len, before, mid, after, **text) -> GenerateResult:
        """A generation's result: its tokens and times, and the executor's counters per decoded token
        (`before`, `mid`, `after`: counters.as_dict() before the prefill, after it and at the end)."""
        decode_steps = max(len(tokens) - 1, 0)
        stats = {key: after[key] - mid.get(key, 0) for key in after if isinstance(after[key], (int, float))}
        stats["prefill_syncs"] = mid.get("syncs", 0) - before.get("syncs", 0)
        stats["syncs_per_token"] = stats.get("syncs", 0) / decode_steps if decode_steps else 0.0
        stats["launches_per_token"] = stats.get("launches", 0) / decode_steps if decode_steps else 0.0
        for key in WINDOW_COUNTERS:       # the residency window's counters (gpu mode under a VRAM budget)
            if key in stats:
                stats[f"{key}_per_token"] = stats[key] / decode_steps if decode_steps else 0.0
        return GenerateResult(tokens, prefill_s, decode_s, prompt_len, stats, **text)

    def generate_chained(self, s: "Session", token: int, steps: int, params=None, seed: int = 0,
                         step: int = 0) -> list[int] | None:
        """The next `steps` tokens of `s` after `token`, chained on the device where the executor can
        (gpu mode: several steps per host sync); None where it cannot.  Greedy, or drawn with sampling
        `params` (text/sampling.py) from (seed, step) onwards, the draws Session.decode_sample makes."""
        sample = None
        if params is not None and not params.greedy:
            from kestrel_stream.run.device.sample_state import pack_state
            sample = pack_state(params, seed, step)
        with self._lock:
            out = self.executor.generate_greedy([(s.kv, np.array([token]), s.position)], steps) if sample is None else \
                self.executor.generate_sampled([(s.kv, np.array([token]), s.position)], steps, [sample])
        if out is None:
            return None
        produced = [int(t) for t in out[:, 0]]
        s.tokens.extend([token] + produced[:-1])     # what each step fed in, as step() records it
        s.position += steps
        return produced

    def fork_kv_of(self, session: "Session", length: int):
        """A cache holding `session`'s first `length` positions and no room beyond (PrefixCache entries)."""
        with self._lock:
            return self.executor.fork_kv(session.kv, length, length)

    def free_kv_of(self, kv) -> None:
        with self._lock:
            self.executor.free_kv(kv)

    def fork_session(self, parent: "Session") -> "Session":
        """A new session continuing from `parent`'s tokens (Session.fork)."""
        with self._lock:         # a step of the executor may be using the parent's cache
            kv = self.executor.fork_kv(parent.kv, parent.position)
        child = Session(self, next(self.session_ids), parent.max_seq_len, kv=kv)
        child.position, child.tokens = parent.position, list(parent.tokens)
        self.sessions[child.id] = child
        return child

    def close(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        for s in list(self.sessions.values()):
            s.close()
        if self.speculation is not None:
            self.speculation.close()
            self.speculation = None
        self.executor.close()
