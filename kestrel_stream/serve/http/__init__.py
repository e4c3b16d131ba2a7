"""The OpenAI-compatible HTTP API of the daemon: an ASGI app under hypercorn, on the daemon's batcher."""
