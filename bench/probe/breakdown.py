"""Critical path of a lone client's decode, stage by stage (needs the probe patch)."""
import os, sys, time, subprocess, signal, statistics, tempfile, json
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import kestrel_stream as ks
from kestrel_stream.presets import ensure_preset
model = ensure_preset("tiny")
want = sys.argv[1] if len(sys.argv) > 1 else "token"
n = 3000
eng = ks.load(model, device="cpu", mode="cpu", max_seq_len=256)
loc = eng.new_session(); loc.prefill([1, 2, 3, 4])
tmp = tempfile.mkdtemp(); sock = tmp + "/s.sock"; log = open(tmp + "/log", "w")
env = dict(os.environ, KS_STAMPS=tmp + "/stamps.json")
p = subprocess.Popen([sys.executable, "-m", "kestrel_stream", "serve", "--model", str(model), "--device", "cpu",
                      "--socket", sock, "--max-seq-len", "256"], stdout=log, stderr=subprocess.STDOUT, env=env)
while "listening on" not in open(tmp + "/log").read(): time.sleep(0.05)
client_stamps, inproc = [], []
with ks.Client(sock) as c, c.new_session() as s:
    s.prefill([1, 2, 3, 4], want="token")
    c.stats()
    for i in range(n):
        if i % 20 == 0:               # blocks of in-process decodes between, as the bench does
            for j in range(20):
                if loc.position + 2 >= 256: loc.reset(); loc.prefill([1, 2, 3, 4])
                t = time.perf_counter(); loc.decode(j + 1); inproc.append(time.perf_counter() - t)
        if s.position + 2 >= 256:
            s.reset(); s.prefill([1, 2, 3, 4], want="token"); client_stamps.append(None); continue
        import kestrel_stream.client as kc
        t0 = time.perf_counter(); s.decode(i % 200 + 1, want=want); t1 = time.perf_counter()
        client_stamps.append((t0, t1) + kc.LAST)
p.send_signal(signal.SIGTERM); p.wait()
server = json.load(open(tmp + "/stamps.json"))
# the server's stamps are decodes only; the client's list has None for the resets (prefills are not stamped)
pairs = [(c, s) for c, s in zip([c for c in client_stamps if c], server)]
pairs = pairs[n // 10:]
def med(f): return statistics.median(f(c, s) for c, s in pairs) * 1e6
rows = {
    "client total": med(lambda c, s: c[1] - c[0]),
    "client call -> encoded": med(lambda c, s: c[3] - c[0]),
    "encoded -> sendall done": med(lambda c, s: c[4] - c[3]),
    "sendall done -> epoll returned": med(lambda c, s: s[5] - c[4]) if any(s[5] for _, s in pairs) else 0,
    "epoll returned -> on_readable": med(lambda c, s: s[0] - s[5]) if any(s[5] for _, s in pairs) else 0,
    "client send -> daemon read": med(lambda c, s: s[0] - c[4]),
    "read -> queued (parse)": med(lambda c, s: s[1] - s[0]),
    "queued -> step start (hop)": med(lambda c, s: s[2] - s[1]),
    "engine step": med(lambda c, s: s[3] - s[2]),
    "answer + send": med(lambda c, s: s[4] - s[3]),
    "sent -> client recv returned": med(lambda c, s: c[5] - s[4]),
    "client parse + return": med(lambda c, s: c[1] - c[5]),
    "inproc decode": statistics.median(inproc[100:]) * 1e6,
}
for k, v in rows.items(): print(f"{k:32s} {v:8.1f} us")
