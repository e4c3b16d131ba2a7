"""Speculative decoding of chains: a draft proposes tokens, the target verifies them in one multi-token step.

draft_model.py (a small model of the same tokenizer, an Engine of its own) and
lookup.py (n-grams of the prompt and the output) propose; accept.py decides
what the target keeps (greedy: the longest prefix its own picks agree with;
sampled: rejection sampling, so the output keeps the target's distribution);
decoder.py runs the rounds on one target session and rewinds its KV to the
accepted path; speculation.py is what an engine carries (`engine.speculation`).
Nothing here imports the engine: sessions and engines come in as arguments.
"""
