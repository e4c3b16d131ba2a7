"""Mode offload's placement and predicted step against its roofline, under a measured pool and what-if costs.

    python3 -m bench.offload_whatif FILE.gguf --weights-mb 1025.8 651.5 \
        --pool '{"host_weight_GBps": 84.58, "h2d_GBps": 52.8, ...}'     # a bench.offload row's "pool"

For each weight budget: the placement the cost model picks (scheduler/offload.place) and its predicted batch-1
step beside the roofline (the non-resident bytes at the pool's best rate), with the measured hand-off costs
(host_call_us: a host segment's call after a device segment; round_trip_us) and with them cut, to show how
much of the gap to the roofline those costs are.  No GPU: the simulation alone (scheduler/step_sim.py).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from kestrel_stream.loading.gguf import GGUFFile
from kestrel_stream.loading.gguf_config import config_from_metadata
from scheduler import offload
from scheduler.offload import HOME_LETTERS
from scheduler.profile import H200_POOL

# (host_call_us, round_trip_us): as measured (None), then cut
WHAT_IF = ((None, None), (8.0, None), (8.0, 8.0), (0.5, 0.5))


def rows(config, weights_mb: list[float], pool: dict) -> list[dict]:
    measured = replace(H200_POOL, **pool)
    out = []
    for call_us, round_trip_us in WHAT_IF:
        profile = replace(measured, host_call_us=call_us or measured.host_call_us,
                          round_trip_us=round_trip_us or measured.round_trip_us)
        for mb in weights_mb:
            placement = offload.place(config, int(mb * 1e6), profile)
            p = placement.predicted
            out.append({"host_call_us": profile.host_call_us, "round_trip_us": profile.round_trip_us,
                        "weights_MB": mb, "layers": "".join(HOME_LETTERS[h] for h in placement.homes),
                        "predicted_ms": round(p.total_us / 1e3, 2), "roofline_ms": round(placement.roofline_us / 1e3, 2),
                        "of_roofline": round(placement.roofline_us / p.total_us, 3),
                        "copy_busy_ms": round(p.copy_busy_us / 1e3, 2), "host_busy_ms": round(p.host_busy_us / 1e3, 2),
                        "handoffs": p.handoffs})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file (its shapes and formats)")
    parser.add_argument("--weights-mb", type=float, nargs="+", required=True, help="weight budgets, MB")
    parser.add_argument("--pool", required=True, help="the measured profile fields, JSON (bench.offload's pool)")
    args = parser.parse_args()
    path = Path(args.model)
    config = config_from_metadata(GGUFFile(path), path)
    for row in rows(config, args.weights_mb, json.loads(args.pool)):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
