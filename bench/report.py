"""Write a benchmark's rows as JSON and a markdown table under bench/results/."""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def on_this_card(name: str, machine: str) -> str:
    """A GPU bench's result name begins "h200-" (the project's reference card); run on another card (the
    machine line names it: "NVIDIA H100 80GB HBM3 sm_90"), it begins with that card's name instead."""
    card = re.search(r"\b([A-Z]\d{2,3}[A-Z]*)\b", machine)
    if name.startswith("h200-") and card and card.group(1).lower() != "h200":
        return card.group(1).lower() + name[4:]
    return name


def write_results(name: str, env: dict, rows: list[dict], columns: list[str], notes: str = "",
                  out_dir: Path | None = None) -> Path:
    name = on_this_card(name, env.get("machine", ""))
    out_dir = Path(out_dir) if out_dir else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{env['date'][:10]}-{name}"
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    runner = f"python3 -m {spec.name}" if spec else f"python3 {sys.argv[0]}"
    command = " ".join([runner] + [shlex.quote(a) for a in sys.argv[1:]])
    payload = {"benchmark": name, "command": command, **env, "rows": rows}
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    lines = [f"# {name}", "", f"- date: {env['date']}", f"- machine: {env['machine']}",
             f"- commit: {env['commit']}", f"- command: `{command}`", ""]
    if notes:
        lines += [notes, ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
