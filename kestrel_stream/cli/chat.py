"""``kestrel-stream chat``: a conversation in the terminal, kept in one session's KV cache.

Each turn renders the whole conversation with the model's chat template, as
every chat front end does, but prefills only the text the session's KV does
not hold yet: the rendering's tail after what is already there (llama.cpp's
conversation mode takes the same difference).  A template that rewrites
earlier turns (e.g. one that drops a past answer's reasoning) makes that
difference impossible; then the turn prefills the whole rendering again, and
the stats line says so.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass

from kestrel_stream.cli.args import UsageError, new_tokens_arg

COMMANDS = """\
/reset          forget the conversation (the system message stays)
/system TEXT    set the system message and start again
/exit           leave (as does end of input, Ctrl-D)
a line ending in \\ continues on the next; a line of three double quotes (\"\"\") starts and ends a block
Ctrl-C stops the answer being written; the conversation keeps what was said"""


def add_chat_args(p) -> None:
    from kestrel_stream.cli.text_args import add_sampling_args
    p.add_argument("--system", default=None, help="the system message the conversation starts with")
    p.add_argument("-n", "--max-new-tokens", type=new_tokens_arg, default=-1, metavar="N",
                   help="most tokens an answer may have; -1 (the default): until the end of generation, as far "
                        "as the session has room")
    add_sampling_args(p)


@dataclass
class TurnStats:
    prefilled: int          # tokens this turn put into the KV before its answer
    generated: int
    decode_tok_s: float
    full_prefill: bool      # the whole conversation was prefilled again (the template rewrote earlier turns)
    reason: str             # eos | stop | length | interrupted


class Conversation:
    """One conversation in one session: every turn's tokens are computed once."""

    def __init__(self, engine, params, max_new_tokens: int = -1, stop=None, ignore_eos: bool = False,
                 system: str | None = None):
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise UsageError(f"{engine.weights.source}: the model has no tokenizer; chat needs one")
        if not tokenizer.chat_template:
            raise UsageError(f"{engine.weights.source}: the model has no chat template; use "
                             f"`generate --prompt TEXT` for plain text")
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.max_new_tokens, self.stop, self.ignore_eos = max_new_tokens, stop, ignore_eos
        self.seed = params.resolved_seed()
        self.steps = 0                  # tokens drawn in this conversation: the sampler's counter
        self.session = engine.new_session()
        # speculative decoding where the engine has a draft (-md, --spec): one decoder for the whole conversation
        self.spec = engine.speculation.decoder(self.session, params, self.seed) if engine.speculation else None
        self.system = system
        self.interrupted = False
        self.reset()

    def reset(self) -> None:
        self.session.reset()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.kv_text = ""               # the text the session's KV holds, as rendered

    def set_system(self, text: str) -> None:
        self.system = text or None
        self.reset()

    def close(self) -> None:
        if self.spec is not None:
            self.spec.close()
        self.session.close()

    def turn_text(self, messages: list[dict]) -> tuple[str, bool]:
        """The text to prefill for `messages` (the conversation with the new user turn) and whether it is the
        whole rendering: the part after what the KV holds, where the rendering starts with it."""
        tok = self.tokenizer
        full = tok.apply_chat_template(messages, add_generation_prompt=True)
        if not self.kv_text:
            return full, False
        if full.startswith(self.kv_text):
            return full[len(self.kv_text):], False
        # the KV holds an answer without its end-of-turn text: the rendering of the turns so far has it
        before = tok.apply_chat_template(self.messages, add_generation_prompt=False)
        if before.startswith(self.kv_text) and full.startswith(before):
            return before[len(self.kv_text):] + full[len(before):], False
        return full, True

    def reply(self, user_text: str):
        """Stream the answer to `user_text` (pieces of text); `self.stats` once it ends."""
        from kestrel_stream.text.detok import IncrementalDecoder
        from kestrel_stream.text.stop import EOS, LENGTH, StopChecker
        s, tok = self.session, self.tokenizer
        messages = self.messages + [{"role": "user", "content": user_text}]
        text, full = self.turn_text(messages)
        ids = tok.encode(text, add_special=False)       # the template writes BOS itself where the model wants one
        room = s.max_seq_len - (0 if full else s.position)
        if len(ids) > room:
            raise UsageError(f"this turn needs {len(ids)} more positions but the session has {room} left of "
                             f"{s.max_seq_len}; /reset starts again (or a larger -c/--max-seq-len)")
        if full:
            s.reset()
        logits = s.prefill(ids, logits="last")
        self.kv_text = (self.kv_text if not full else "") + text
        self.messages = messages
        room = s.max_seq_len - s.position + 1           # the last token drawn is not fed
        budget = room if self.max_new_tokens == -1 else min(self.max_new_tokens, room)
        eos = () if self.ignore_eos else tok.eos_ids
        stop = StopChecker(eos, self.stop, budget)
        decoder = IncrementalDecoder(tok, ids)
        answer: list[int] = []          # the answer's tokens fed to the KV
        start = s.position
        pending = [self._draw(logits)]
        t0 = time.perf_counter()
        self.interrupted = False
        while pending:
            token = pending.pop(0)
            is_eos = token in stop.eos_ids
            piece = stop.push(token, decoder.push(token) if not is_eos else "")
            if stop.reason in (EOS, LENGTH):
                piece += stop.finish(decoder.flush())
            if piece:
                yield piece
            if stop.reason is not None or self.interrupted:
                break
            answer.append(token)
            if not pending:
                pending = self._next(s, token, budget - stop.count)
        if s.position > start + len(answer):        # a speculative round ran past the end: the KV keeps the answer
            s.truncate(start + len(answer))
        elapsed_s = time.perf_counter() - t0
        said = tok.decode(answer)
        self.kv_text += said
        self.messages = messages + [{"role": "assistant", "content": said}]
        reason = "interrupted" if self.interrupted and stop.reason is None else stop.reason
        generated = stop.count
        decode_tok_s = (generated - 1) / elapsed_s if generated > 1 and elapsed_s > 0 else 0.0
        self.stats = TurnStats(len(ids), generated, decode_tok_s, full, reason)

    def _draw(self, logits) -> int:
        from kestrel_stream.text.sampling import sample_logits
        token = sample_logits(logits, self.params, self.seed, self.steps, self.session.tokens)
        self.steps += 1
        return token

    def _next(self, s, token: int, budget: int) -> list[int]:
        """Feed `token`, draw what follows: a speculative round's tokens (at most `budget`), or one token
        on the device where it can (greedy or sampled), else on the host."""
        params, step = self.params, self.steps
        if self.spec is not None:
            out = self.spec.next_tokens(token, s.tokens + [token], step, budget)
            self.steps += len(out)
            return out
        if params.penalized:
            return [self._draw(s.decode(token))]
        self.steps += 1
        return [s.decode_greedy(token) if params.greedy else s.decode_sample(token, params, self.seed, step)]


def read_message(prompt: str):
    """One message from stdin: a line; lines joined while they end in a backslash; or a block between lines of
    three double quotes.  None at end of input."""
    try:
        line = input(prompt)
    except EOFError:
        return None
    if line.strip() == '"""':
        lines = []
        while True:
            try:
                line = input("")
            except EOFError:
                break
            if line.strip() == '"""':
                break
            lines.append(line)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        try:
            line = input("... " if prompt else "")
        except EOFError:
            line = ""
            break
    lines.append(line)
    return "\n".join(lines)


def run_chat(args, engine) -> int:
    """The conversation on stdin and stdout, until end of input or /exit; closes `engine`."""
    from kestrel_stream.text.sampling import SamplingParams
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, seed=args.seed)
    conversation = Conversation(engine, params, args.max_new_tokens, args.stop, args.ignore_eos, args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
        print(f"kestrel-stream chat: {args.model} ({engine.device}, mode {engine.mode}); /help lists the commands",
              file=sys.stderr)
    try:
        while True:
            message = read_message("> " if interactive else "")
            if message is None:
                break
            if not message.strip():
                continue
            if message.startswith("/") and command(conversation, message):
                continue
            if message.strip() in ("/exit", "/quit"):
                break
            answer(conversation, message)
    finally:
        conversation.close()
        engine.close()
    return 0


def command(conversation: Conversation, message: str) -> bool:
    """Run a /command; False for /exit (and text that only starts with a slash, which is a message)."""
    name, _, rest = message.strip().partition(" ")
    if name == "/reset":
        conversation.reset()
        print("(the conversation starts again)", file=sys.stderr)
    elif name == "/system":
        conversation.set_system(rest.strip())
        print("(system message set; the conversation starts again)", file=sys.stderr)
    elif name in ("/help", "/?"):
        print(COMMANDS, file=sys.stderr)
    else:
        return False
    return True


def answer(conversation: Conversation, message: str) -> None:
    """Stream one answer to stdout; Ctrl-C stops it (the part said stays in the conversation)."""
    def stop_answer(signum, frame):
        conversation.interrupted = True
    previous = signal.signal(signal.SIGINT, stop_answer)
    try:
        for piece in conversation.reply(message):
            sys.stdout.write(piece)
            sys.stdout.flush()
    except UsageError as e:
        print(f"kestrel-stream chat: {e}", file=sys.stderr)
        return
    finally:
        signal.signal(signal.SIGINT, previous)
    print(flush=True)
    st = conversation.stats
    again = "; the template rewrote earlier turns, so all of it" if st.full_prefill else ""
    print(f"[prefilled {st.prefilled} tokens{again}; {st.generated} tokens at {st.decode_tok_s:.1f} tok/s; "
          f"{st.reason}]", file=sys.stderr, flush=True)
