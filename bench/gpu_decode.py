"""`gpu` mode decode and prefill on the qwen3-1.7b shape with random in-memory weights.

    PYTHONPATH=. python3 -m bench.gpu_decode [--out DIR] [--commit HASH]

Reports decode tok/s and ms/token end to end through GpuExecutor.forward (graph
replay + the step's one sync + logits copy), the GPU time of one replayed step
(back-to-back replays timed with events), prefill tok/s, and achieved weight
bandwidth (quantized weight bytes per token / time) as a fraction of the
device-to-device copy bandwidth measured here and of the 4.46 TB/s HBM read figure.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kestrel_stream.cli.bench import environment
from kestrel_stream.model.config import ModelConfig
from kestrel_stream.cuda import driver
from kestrel_stream.run.compat import GpuExecutor
from kestrel_stream.model.quant import QTensor
from kestrel_stream.model.weights import LayerWeights, ModelWeights

from .gpu_kernels import measure_copy_bandwidth
from .report import write_results

QWEN3_1_7B = dict(arch="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                  rope_theta=1e6, tie_word_embeddings=True)
HBM_READ_GB_S = 4460.0


def random_weights(rng) -> ModelWeights:
    """Random Q8_0 weights drawn directly (no float matrices, no quantization pass)."""
    c = ModelConfig(**QWEN3_1_7B)

    def linear(n, k):
        scales = np.full((n, k // 32), 1.0 / (73.0 * np.sqrt(k)), np.float16)   # int8 std ~73
        return QTensor(rng.integers(-127, 128, (n, k), dtype=np.int8), scales)

    def norm(n):
        return np.ones(n, np.float32)

    H, I = c.hidden_size, c.intermediate_size
    layers = [LayerWeights(norm(H), linear(c.q_size + 2 * c.kv_size, H), linear(H, c.q_size), norm(H),
                           linear(2 * I, H), linear(H, I), norm(c.head_dim), norm(c.head_dim))
              for _ in range(c.num_hidden_layers)]
    embed = QTensor(rng.integers(-127, 128, (c.vocab_size, H), dtype=np.int8),
                    np.full((c.vocab_size, H // 32), 1.0 / 127, np.float16))
    return ModelWeights(c, embed, layers, norm(H), embed, source="random qwen3-1.7b")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("KESTREL_COMMIT"))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"], help="the paged KV pool's type")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    max_batch, max_seq_len = max(8, *batches), max(1024, args.prompt_len + args.new_tokens + 16)
    rng = np.random.default_rng(0)
    weights = random_weights(rng)
    weight_bytes = weights.quantized_bytes()
    t0 = time.perf_counter()
    gpu = GpuExecutor(weights, max_seq_len=max_seq_len, max_batch=max_batch, max_sessions=max_batch, prefill_chunk=64,
                      kv_dtype=args.kv_dtype)
    load_s = time.perf_counter() - t0
    copy_arena = driver.Arena(2 * (256 << 20) + (1 << 20))   # the executor's arena holds only what it needs
    copy_gb_s = measure_copy_bandwidth(copy_arena, gpu.steps.stream, 256 << 20)
    copy_arena.release()
    rows = []
    prompt = rng.integers(0, 151936, args.prompt_len)
    kv = gpu.alloc_kv(max_seq_len)
    gpu.forward([(kv, prompt[:8], 0)])             # warm-up: module load, first launches
    gpu.free_kv(kv)
    for batch in batches:
        sessions = [gpu.alloc_kv(max_seq_len) for _ in range(batch)]
        t0 = time.perf_counter()
        for kv in sessions:
            gpu.forward([(kv, prompt, 0)])
        prefill_s = time.perf_counter() - t0
        tokens = [int(t) for t in rng.integers(0, 151936, batch)]
        step_batch = lambda pos: [(kv, np.array([tokens[i]]), pos) for i, kv in enumerate(sessions)]
        gpu.forward(step_batch(args.prompt_len))      # capture this bucket's graph
        syncs0 = gpu.stats["syncs"]
        t0 = time.perf_counter()
        for step in range(1, args.new_tokens + 1):
            gpu.forward(step_batch(args.prompt_len + step))
        decode_s = time.perf_counter() - t0
        syncs = gpu.stats["syncs"] - syncs0
        gpu.forward_greedy(step_batch(args.prompt_len))   # capture the greedy graph
        t0 = time.perf_counter()
        for step in range(1, args.new_tokens + 1):
            gpu.forward_greedy(step_batch(args.prompt_len + step))
        greedy_s = time.perf_counter() - t0
        chain_rows = [(kv, np.array([tokens[i]]), args.prompt_len) for i, kv in enumerate(sessions)]
        gpu.generate_greedy(chain_rows, 2)                # capture the chain graph
        t0 = time.perf_counter()
        chained = gpu.generate_greedy(chain_rows, args.new_tokens)    # None past graph_rows sessions
        chained_s = time.perf_counter() - t0
        # a batch past graph_rows replays the graph_rows bucket in chunks
        graph_us = replay_us(gpu, min(batch, gpu.steps.graph_rows)) * -(-batch // gpu.steps.graph_rows)
        step_ms = decode_s / args.new_tokens * 1000
        row = {"batch": batch, "kv_dtype": args.kv_dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "prefill_tok_s": round(batch * args.prompt_len / prefill_s, 1),
               "decode_tok_s": round(batch * args.new_tokens / decode_s, 1),
               "greedy_tok_s": round(batch * args.new_tokens / greedy_s, 1),
               "chained_tok_s": round(batch * args.new_tokens / chained_s, 1) if chained is not None else None,
               "ms_per_step": round(step_ms, 3), "gpu_ms_per_step": round(graph_us / 1000, 3),
               "syncs_per_step": syncs / args.new_tokens,
               "weight_GB_s": round(weight_bytes / (step_ms / 1000) / 1e9, 1),
               "frac_d2d_copy": round(weight_bytes / (step_ms / 1000) / 1e9 / copy_gb_s, 3),
               "frac_hbm_read_gpu_only": round(weight_bytes / graph_us / 1e3 / HBM_READ_GB_S, 3)}
        print(row, flush=True)
        rows.append(row)
        for kv in sessions:
            gpu.free_kv(kv)
    env = environment()
    env.update(machine=driver.detect(), commit=args.commit or env["commit"], d2d_copy_GB_s=round(copy_gb_s, 1),
               weight_MB=round(weight_bytes / 1e6, 1), load_s=round(load_s, 2),
               kernels_per_step=gpu.steps._graph_kernels.get((1, False)))
    notes = (f"qwen3-1.7b shape (28 layers, hidden 2048, intermediate 6144, 16/8 heads, head_dim 128, "
             f"vocab 151936, tied), random Q8_0 weights, {weight_bytes / 1e6:.0f} MB read per step. "
             f"Device-to-device copy measured here: {copy_gb_s:.0f} GB/s (read + write). "
             f"ms_per_step: end to end through forward() (graph replay, one sync, logits copy to host); "
             f"greedy_tok_s: through forward_greedy() (the argmax on the device, 4 bytes per token back), "
             f"what greedy daemon decodes use; chained_tok_s: generate_greedy(), the greedy steps chained on the "
             f"device, one sync for all of them (what generate() uses); "
             f"gpu_ms_per_step: back-to-back graph replays timed with events. "
             f"{gpu.steps._graph_kernels.get((1, False))} kernels per decode step.")
    path = write_results("h200-gpu-decode", env, rows,
                         ["batch", "kv_dtype", "prompt_len", "new_tokens", "prefill_tok_s", "decode_tok_s", "greedy_tok_s", "chained_tok_s", "ms_per_step",
                          "gpu_ms_per_step", "syncs_per_step", "weight_GB_s", "frac_d2d_copy",
                          "frac_hbm_read_gpu_only"], notes=notes, out_dir=args.out)
    print(f"wrote {path}")
    gpu.close()


def replay_us(gpu: GpuExecutor, bucket: int, replays: int = 20) -> float:
    """GPU time of one decode step: the bucket's graph replayed back to back (same positions)."""
    graph = gpu.steps._graphs[(bucket, False)]
    start, stop = driver.Event(timing=True), driver.Event(timing=True)
    start.record(gpu.steps.stream)
    for _ in range(replays):
        graph.launch(gpu.steps.stream)
    stop.record(gpu.steps.stream)
    stop.synchronize()
    return stop.elapsed_ms(start) * 1000 / replays


if __name__ == "__main__":
    main()
