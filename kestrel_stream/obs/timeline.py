"""``kestrel-stream timeline TRACE -o OUT.html``: a self-contained HTML timeline of a trace.

One inline SVG, no network and no external scripts: a row per host thread and
per device stream (nested host spans stacked in lanes), copies coloured apart
from kernels, a ``<title>`` on every slice for hover details, and a few lines
of inline JS for wheel zoom, drag to scroll and the time axis.  The terminal
summary (``trace_summary``) is printed and also embedded below the timeline.
"""
from __future__ import annotations

import hashlib
import html
import json
from pathlib import Path

from kestrel_stream.obs import trace_summary

LANE_PX = 14
ROW_GAP_PX = 6
LABEL_PX = 250
COLOURS = {                     # fixed colours for the kinds a reader must tell apart at a glance
    "memcpy h2d": "#f28e2b", "memcpy d2h": "#b07aa1", "sync": "#e15759", "launch": "#555555",
    "copy": "#8c6d31", "step": "#d9d9d9", "instant": "#000000",
}
# Host ops: a categorical palette kept clear of the kernel blues and the copy/sync colours.
HOST_PALETTE = ["#59a14f", "#b6992d", "#499894", "#d37295", "#9d7660", "#8cd17d", "#f1ce63", "#86bcb6",
                "#fabfd2", "#d7b5a6", "#2f6b2f", "#c9b400", "#6b4226", "#e377c2", "#17becf", "#bcbd22"]
LEGEND = [("kernel", "hsl(210,65%,50%)"), ("memcpy h2d", COLOURS["memcpy h2d"]),
          ("memcpy d2h", COLOURS["memcpy d2h"]), ("sync / wait", COLOURS["sync"]),
          ("launch (host)", COLOURS["launch"]), ("host op", HOST_PALETTE[0]), ("step", COLOURS["step"]),
          ("event record/wait", COLOURS["instant"])]


def _hue(name: str, lo: int, hi: int) -> int:
    # Stable per op name across traces, so the same op keeps its colour run to run.
    return lo + int(hashlib.md5(name.encode()).hexdigest()[:6], 16) % (hi - lo)


def colour(event: dict, host_colours: dict) -> str:
    cat, name, args = event.get("cat", ""), event.get("name", ""), event.get("args", {})
    if cat == "memcpy":
        return COLOURS["memcpy d2h"] if args.get("direction") == "d2h" else COLOURS["memcpy h2d"]
    if cat == "sync":
        return COLOURS["sync"]
    if args.get("kind") in ("launch", "copy"):
        return COLOURS[args["kind"]]
    if cat == "kernel":
        return f"hsl({_hue(name, 190, 260)},65%,{45 + _hue(name, 0, 15)}%)"
    if name == "step":
        return COLOURS["step"]
    return host_colours.get(name) or HOST_PALETTE[_hue(name, 0, len(HOST_PALETTE))]


def host_op_colours(slices: list[dict]) -> dict:
    """Host op name -> colour, in name order: distinct for up to len(HOST_PALETTE) ops in one trace."""
    names = sorted({e["name"] for e in slices if e.get("cat") == "host" and "op" in e.get("args", {})})
    return {name: HOST_PALETTE[i % len(HOST_PALETTE)] for i, name in enumerate(names)}


def lanes(slices: list[dict]) -> list[tuple[dict, int]]:
    """(slice, depth) with nested slices one lane below their parent."""
    placed, open_ends = [], []
    for e in sorted(slices, key=lambda e: (e["ts"], -e["dur"])):
        while open_ends and open_ends[-1] <= e["ts"]:
            open_ends.pop()
        placed.append((e, len(open_ends)))
        open_ends.append(e["ts"] + e["dur"])
    return placed


def tooltip(event: dict, origin_us: float) -> str:
    args = event.get("args", {})
    head = (f"{event['name']} [{event.get('cat', '')}]\n"
            f"start {(event['ts'] - origin_us) / 1000:.4f} ms, dur {event.get('dur', 0):.2f} us")
    return html.escape(head + ("\n" + json.dumps(args) if args else ""))


def render_svg(row_list: list[trace_summary.Row], origin_us: float, span_us: float,
               host_colours: dict) -> tuple[str, str, int, dict]:
    """(label SVG, timeline SVG, height px, slice midpoints); timeline x is in us since ``origin_us``.

    The midpoints map (pid, tid, ts + dur/2) to a slice's lane centre: the
    recorder puts flow ends exactly there, so arrows can start at the right lane.
    """
    labels, shapes, y, mids = [], [], 0, {}
    for index, row in enumerate(row_list):
        placed = lanes(row.slices)
        depth = max((d for _, d in placed), default=0) + 1
        height = depth * LANE_PX
        band = "#f7f7f7" if index % 2 == 0 else "#ffffff"
        shapes.append(f'<rect x="0" y="{y}" width="{span_us:.3f}" height="{height + ROW_GAP_PX}" fill="{band}"/>')
        labels.append(f'<text x="6" y="{y + 11}" font-size="11">{html.escape(row.label)}</text>')
        for e, d in placed:
            top = y + d * LANE_PX + 1
            shapes.append(f'<rect x="{e["ts"] - origin_us:.3f}" y="{top}" width="{max(e["dur"], 0.0):.3f}" '
                          f'height="{LANE_PX - 2}" fill="{colour(e, host_colours)}">'
                          f'<title>{tooltip(e, origin_us)}</title></rect>')
            mids[(e["pid"], e["tid"], e["ts"] + e["dur"] / 2)] = top + LANE_PX / 2
        for e in row.instants:
            shapes.append(f'<rect x="{e["ts"] - origin_us:.3f}" y="{y}" width="0.001" height="{height}" '
                          f'fill="{COLOURS["instant"]}" stroke="{COLOURS["instant"]}">'
                          f'<title>{tooltip(e, origin_us)}</title></rect>')
        y += height + ROW_GAP_PX
    return "\n".join(labels), "\n".join(shapes), y, mids


def flow_lines(events: list[dict], mids: dict, origin_us: float) -> str:
    """Launch → kernel arrows as thin lines (toggled by a checkbox); flows not at a slice midpoint are left out."""
    starts = {e["id"]: e for e in events if e.get("ph") == "s"}
    out = []
    for f in (e for e in events if e.get("ph") == "f" and e["id"] in starts):
        s = starts[f["id"]]
        y0, y1 = mids.get((s["pid"], s["tid"], s["ts"])), mids.get((f["pid"], f["tid"], f["ts"]))
        if y0 is not None and y1 is not None:
            out.append(f'<line x1="{s["ts"] - origin_us:.3f}" y1="{y0}" x2="{f["ts"] - origin_us:.3f}" y2="{y1}"/>')
    return "\n".join(out)


SCRIPT = """
const svg = document.getElementById('tl'), axis = document.getElementById('axis');
const FULL = [0, SPAN], H = HEIGHT; let view = FULL.slice(), drag = null;
function nice(x) { const p = Math.pow(10, Math.floor(Math.log10(x))); const m = x / p;
  return (m < 2 ? 1 : m < 5 ? 2 : 5) * p; }
function apply() {
  svg.setAttribute('viewBox', view[0] + ' 0 ' + (view[1] - view[0]) + ' ' + H);
  const w = axis.clientWidth, span = view[1] - view[0], tick = nice(span / 8); let out = '';
  for (let t = Math.ceil(view[0] / tick) * tick; t <= view[1]; t += tick) {
    const x = (t - view[0]) / span * w, digits = Math.max(0, -Math.floor(Math.log10(tick / 1000)));
    out += '<line x1="' + x + '" x2="' + x + '" y1="14" y2="22" stroke="#444"/>' +
           '<text x="' + (x + 2) + '" y="12" font-size="10">' + (t / 1000).toFixed(digits) + ' ms</text>';
  }
  axis.innerHTML = out;
}
function clamp(span) { span = Math.min(Math.max(span, 0.05), FULL[1]);
  let a = Math.max(FULL[0], Math.min(view[0], FULL[1] - span)); view = [a, a + span]; }
svg.addEventListener('wheel', e => { e.preventDefault(); const r = svg.getBoundingClientRect();
  const f = (e.clientX - r.left) / r.width, at = view[0] + f * (view[1] - view[0]);
  const span = (view[1] - view[0]) * (e.deltaY < 0 ? 0.8 : 1.25); view[0] = at - f * span; clamp(span); apply();
}, {passive: false});
svg.addEventListener('mousedown', e => { drag = [e.clientX, view[0]]; });
window.addEventListener('mouseup', () => { drag = null; });
window.addEventListener('mousemove', e => { if (!drag) return; const span = view[1] - view[0];
  view[0] = drag[1] - (e.clientX - drag[0]) / svg.getBoundingClientRect().width * span; clamp(span); apply(); });
document.getElementById('fit').onclick = () => { view = FULL.slice(); apply(); };
document.getElementById('flows').onchange = e => {
  document.getElementById('flowlines').style.display = e.target.checked ? '' : 'none'; };
window.addEventListener('resize', apply); apply();
"""


def render_html(events: list[dict], title: str, summary_text: str) -> str:
    row_list = trace_summary.rows(events)
    slices = [e for r in row_list for e in r.slices] or [{"ts": 0.0, "dur": 1.0}]
    origin_us = min(e["ts"] for e in slices)
    span_us = max(max(e["ts"] + e["dur"] for e in slices) - origin_us, 1.0)
    host_colours = host_op_colours(slices)
    labels, shapes, height, mids = render_svg(row_list, origin_us, span_us, host_colours)
    legend = "".join(f'<span class="key"><i style="background:{c}"></i>{html.escape(name)}</span>'
                     for name, c in LEGEND)
    if host_colours:
        legend += "<br>host ops: " + "".join(f'<span class="key"><i style="background:{c}"></i>{html.escape(n)}</span>'
                                             for n, c in list(host_colours.items())[:len(HOST_PALETTE)])
    script = SCRIPT.replace("SPAN", f"{span_us:.3f}").replace("HEIGHT", str(height))
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 13px sans-serif; margin: 12px; }}
.key {{ margin-right: 14px; white-space: nowrap; }}
.key i {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -2px; }}
#wrap {{ display: flex; border: 1px solid #ccc; }}
#right {{ flex: 1; overflow: hidden; }}
#tl rect {{ vector-effect: non-scaling-stroke; }}
#flowlines line {{ stroke: #333; stroke-opacity: 0.35; vector-effect: non-scaling-stroke; }}
pre {{ background: #f4f4f4; padding: 8px; }}
</style></head><body>
<h3>{html.escape(title)}</h3>
<div>{legend} <button id="fit">fit</button>
<label><input type="checkbox" id="flows" checked> launch arrows</label>
<span style="color:#777"> wheel: zoom, drag: scroll, hover: details</span></div>
<div id="wrap">
<svg width="{LABEL_PX}" height="{height + 24}"><g transform="translate(0,24)">{labels}</g></svg>
<div id="right"><svg id="axis" width="100%" height="24"></svg>
<svg id="tl" width="100%" height="{height}" viewBox="0 0 {span_us:.3f} {height}" preserveAspectRatio="none">
{shapes}
<g id="flowlines">{flow_lines(events, mids, origin_us)}</g>
</svg></div></div>
<pre>{html.escape(summary_text)}</pre>
<script>{script}</script>
</body></html>
"""


def run(trace_path: str, output: str | None, steps: str | None) -> tuple[Path, str]:
    """Write the HTML timeline of ``trace_path``; returns (file written, terminal summary)."""
    first, stop = trace_summary.parse_steps(steps)
    events = trace_summary.select_steps(trace_summary.load(trace_path), first, stop)
    summary_text = trace_summary.format_summary(trace_summary.summarize(events))
    name = Path(trace_path).name
    out = Path(output) if output else Path(trace_path).with_name(name.split(".")[0] + ".html")
    title = f"kestrel-stream timeline: {name}" + (f", steps {steps}" if steps else "")
    out.write_text(render_html(events, title, summary_text), encoding="utf-8")
    return out, summary_text
