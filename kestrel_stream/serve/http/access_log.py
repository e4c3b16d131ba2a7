"""One line per HTTP request on stderr, once its response has been sent (or abandoned): who, what, the status, the
generation's prompt and completion tokens, its wait for a session, time to first token, and the whole duration.

    kestrel-stream serve: 127.0.0.1:50312 "POST /v1/chat/completions" 200 prompt=24 completion=31 queue=0.000s
        ttft=0.041s time=0.512s

A generation hands its figures to the line through the request's ASGI state (``GENERATION_KEY``); other routes
log the first four fields and the time.  499 is a client that left before its answer (as nginx logs it).
``serve --no-access-log`` turns the lines off.
"""
from __future__ import annotations

import sys

GENERATION_KEY = "kestrel_generation"       # scope["state"][key]: the request's HttpGeneration


def access_line(scope, status: int, duration_s: float) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    path = scope.get("path", "")
    line = f'{who} "{scope.get("method", "-")} {path[:200]}" {status}'
    generation = scope.get("state", {}).get(GENERATION_KEY)
    if generation is not None:
        line += (f" prompt={generation.prompt_tokens} completion={generation.completion_tokens}"
                 f" queue={generation.queue_wait_s:.3f}s")
        if generation.first_token_s is not None:
            line += f" ttft={generation.first_token_s:.3f}s"
    return f"{line} time={duration_s:.3f}s"


def write_access_line(scope, status: int, duration_s: float) -> None:
    print(f"kestrel-stream serve: {access_line(scope, status, duration_s)}", file=sys.stderr, flush=True)
