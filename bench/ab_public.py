"""A/B through the public API only, so two source trees run the same measuring code.

    PYTHONPATH=TREE python3 ab_public.py MODEL --label L [--modes gpu,window,gated] > out.json
"""
import argparse, json, sys, time
import numpy as np
import kestrel_stream as ks


def decode_rates(eng, batch, prompt_len, steps, rng):
    sessions = [eng.new_session() for _ in range(batch)]
    prompt = [int(t) for t in rng.integers(0, eng.config.vocab_size, prompt_len)]
    for s in sessions:
        s.prefill(prompt)
    tokens = [int(t) for t in rng.integers(0, eng.config.vocab_size, batch)]
    pairs = lambda: [(s, tokens[i]) for i, s in enumerate(sessions)]
    for _ in range(3):                                       # warm-up / graph capture
        if batch == 1:
            sessions[0].decode_greedy(tokens[0])
        else:
            eng.decode_batch(pairs(), greedy=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        if batch == 1:
            sessions[0].decode_greedy(tokens[0])
        else:
            eng.decode_batch(pairs(), greedy=True)
    dt = time.perf_counter() - t0
    for s in sessions:
        s.close()
    return batch * steps / dt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model"); p.add_argument("--label", required=True)
    p.add_argument("--modes", default="gpu,window,gated"); p.add_argument("--steps", type=int, default=64)
    p.add_argument("--window-budget", default=None, help="vram budget giving ~50%% of the weights resident")
    a = p.parse_args()
    out = {"label": a.label}
    rng = np.random.default_rng(0)
    for mode in a.modes.split(","):
        kw = dict(device="cuda", max_seq_len=512)
        if mode == "window":
            kw.update(mode="gpu", vram_budget=a.window_budget)
        else:
            kw.update(mode=mode)
        eng = ks.load(a.model, **kw)
        if mode == "gpu":
            out["gpu_b1_tok_s"] = decode_rates(eng, 1, 128, a.steps, rng)
            out["gpu_b8_tok_s"] = decode_rates(eng, 8, 128, a.steps, rng)
            r = eng.generate(list(range(1, 129)), max_new_tokens=a.steps)
            out["gpu_generate_tok_s"] = r.decode_tok_s
        elif mode == "window":
            out["window50_b1_tok_s"] = decode_rates(eng, 1, 128, max(a.steps // 4, 8), rng)
        else:
            out[f"{mode}_b1_tok_s"] = decode_rates(eng, 1, 128, max(a.steps // 4, 8), rng)
        eng.close()
        del eng
    print(json.dumps(out))


if __name__ == "__main__":
    main()
