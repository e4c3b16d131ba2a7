"""CPU engine decode A/B: ms per step of the tiny model, two source trees in alternating fresh processes.

    python3 bench/cpu_ab.py MODEL_DIR TREE_A TREE_B [--rounds 8] [--steps 300] [--threads 1]

(The workers run in /, so neither tree is shadowed by a package in the current directory.)

Each round runs both trees in fresh processes (order alternating), --threads BLAS threads (the native host
kernels take the physical cores unless told otherwise); a process decodes
STEPS tokens in four chunks after 50 warm-up steps and reports its best chunk.
"""
import json, os, statistics as st, subprocess, sys

WORKER = r'''
import sys, time, numpy as np, kestrel_stream as ks
eng = ks.load(sys.argv[1], device="cpu")
s = eng.new_session(max_seq_len=512) if "max_seq_len" in eng.new_session.__code__.co_varnames else eng.new_session()
s.prefill([1, 2, 3])
for _ in range(min(50, int(sys.argv[2]) // 4)): s.decode(7)
s.truncate(3)
chunks = []
for c in range(4):
    t = time.perf_counter()
    for _ in range(int(sys.argv[2]) // 4): s.decode(7)
    chunks.append((time.perf_counter() - t) * 1e3 / (int(sys.argv[2]) // 4))
    s.truncate(3)
print(min(chunks))
'''

def main():
    model, a, b = sys.argv[1:4]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 8
    steps = sys.argv[sys.argv.index("--steps") + 1] if "--steps" in sys.argv else "300"
    threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv else "1"
    out = {a: [], b: []}
    for r in range(rounds):
        for tree in ((a, b) if r % 2 == 0 else (b, a)):
            env = dict(os.environ, PYTHONPATH=tree, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
            ms = float(subprocess.run([sys.executable, "-c", WORKER, model, steps], env=env, cwd="/", capture_output=True,
                                      text=True, check=True).stdout.split()[-1])
            out[tree].append(ms)
    for tree, v in out.items():
        print(json.dumps({"tree": tree, "ms_per_step": v, "median": st.median(v), "best": min(v)}))
    print(f"ratio new/base median {st.median(out[a]) / st.median(out[b]):.3f} best {min(out[a]) / min(out[b]):.3f}")

main()
