"""CPU engine decode and prefill throughput on the tiny and qwen3-0.6b presets.

    python3 -m bench.cpu_decode [--presets tiny,qwen3-0.6b] [--new-tokens 32] [--out DIR]
"""
from __future__ import annotations

import argparse

import kestrel_stream as ks
from kestrel_stream.cli.bench import environment, measure
from kestrel_stream.loading.presets import ensure_preset

from .report import write_results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", default="tiny,qwen3-0.6b")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for preset in args.presets.split(","):
        engine = ks.load(ensure_preset(preset), device="cpu")
        row = measure(engine, prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats)
        row = {"preset": preset, "weights_MB": round(engine.weights.quantized_bytes() / 1e6, 1), **row}
        print(row, flush=True)
        rows.append(row)
        engine.close()
    path = write_results("cpu-decode", environment(), rows,
                         ["preset", "weights_MB", "prompt_len", "new_tokens", "prefill_tok_s", "decode_tok_s",
                          "ms_per_token", "syncs_per_token"], out_dir=args.out,
                         notes="CPU engine (numpy, float32 BLAS on dequantized Q8_0 weights); median of repeats.")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
