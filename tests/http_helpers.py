"""A daemon with --http started for a test, and a tiny model whose tokenizer has a chat template."""
from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path

from daemon_helpers import ENV, DaemonProcess

from kestrel_stream.loading.presets import PRESETS, make_model

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
CONTEXT = 2048                  # the engine's default max_seq_len: a generation to its end outlasts a test's disconnect


def chat_model(directory: Path) -> Path:
    """The tiny preset (byte-level tokenizer, 256 ids) with a chat template in tokenizer_config.json."""
    path = make_model(directory, replace(PRESETS["tiny"], max_position_embeddings=CONTEXT), seed=1, dtype="f32")
    (Path(path) / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return Path(path)


class HttpDaemon(DaemonProcess):
    """``serve --socket ... --http 127.0.0.1:0``; ``base_url`` is its http://host:port/v1."""

    def __init__(self, model, tmp_path: Path, *flags: str, env: dict | None = None):
        super().__init__(model, tmp_path / "daemon.log", "--socket", str(tmp_path / "d.sock"),
                         "--http", "127.0.0.1:0", *flags, env=env or ENV)
        self.base_url = self.wait_for_http()

    def wait_for_http(self, timeout_s: float = 30.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(r"http listening on (http://\S+/v1)", self.log_path.read_text())
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"no http listening line within {timeout_s} s:\n{self.log_path.read_text()}")


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, f"no sample {name} in /metrics"
    return float(found.group(1))
