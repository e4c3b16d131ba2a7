"""The HTML timeline: self-contained, and it really renders (a headless Chromium screenshot)."""
from __future__ import annotations

import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest

from kestrel_stream.obs import timeline
from kestrel_stream.obs import trace_summary
from trace_checks import gpu_shaped_trace

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.fixture
def gpu_html(tmp_path):
    path = tmp_path / "gpu.json.gz"
    gpu_shaped_trace(path)
    out, summary = timeline.run(str(path), str(tmp_path / "gpu.html"), None)
    return out, summary


def test_html_is_self_contained_with_rows_legend_and_hover(gpu_html):
    out, summary = gpu_html
    text = out.read_text()
    for needle in ("src=", "href=", "http://", "https://", "@import", "url("):
        assert needle not in text, f"{needle!r} would reach outside the file"
    assert "cuda:0 synthetic / compute" in text and "cuda:0 synthetic / copy h2d" in text and "host / main" in text
    assert text.count("<title>") >= text.count("<rect") - 10, "every slice has hover details"
    assert timeline.COLOURS["memcpy h2d"] in text and "memcpy h2d" in text     # copies coloured apart, in the legend
    assert "<line" in text, "launch arrows are drawn"
    assert summary in text.replace("&#x27;", "'") and "busy per stream" in summary


def read_png_rgb(data: bytes) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA, non-interlaced PNG into [H, W, 3] uint8 (zlib + the five row filters)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour_type in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    channels = 3 if colour_type == 2 else 4
    stride = width * channels
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), np.int32)
    prior = np.zeros(stride, np.int32)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        if kind == 0:
            row = line
        elif kind == 2:
            row = (line + prior) & 255
        elif kind == 1:      # Sub: a running sum per channel
            row = np.cumsum(line.reshape(width, channels), axis=0).reshape(stride) & 255
        else:                # Average and Paeth depend on the pixel just decoded: byte by byte
            row, line_list, up = [0] * stride, line.tolist(), prior.tolist()
            for i in range(stride):
                left = row[i - channels] if i >= channels else 0
                upper_left = up[i - channels] if i >= channels else 0
                if kind == 3:
                    predict = (left + up[i]) // 2
                else:
                    p = left + up[i] - upper_left
                    pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - upper_left)
                    predict = left if pa <= pb and pa <= pc else (up[i] if pb <= pc else upper_left)
                row[i] = (line_list[i] + predict) & 255
            row = np.array(row, np.int32)
        out[y] = prior = row
    return out.reshape(height, width, channels)[:, :, :3].astype(np.uint8)


def screenshot(html_path, png_path, profile_dir) -> bytes:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile_dir}", f"--screenshot={png_path}", "--window-size=1400,800",
           f"file://{html_path}"]
    subprocess.run(cmd, capture_output=True, timeout=120)
    assert png_path.exists(), "chromium wrote no screenshot"
    return png_path.read_bytes()


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI installs it with apt-get)")
def test_timeline_renders_in_headless_chromium(gpu_html, tmp_path):
    out, _ = gpu_html
    pixels = read_png_rgb(screenshot(out.resolve(), tmp_path / "shot.png", tmp_path / "profile"))
    assert pixels.shape == (800, 1400, 3)
    colours = {tuple(c) for c in pixels.reshape(-1, 3)[::7].tolist()}
    assert len(colours) > 50, "a blank or flat page"
    assert (pixels.reshape(-1, 3) != 255).any(axis=1).mean() > 0.02
    h2d = tuple(int(timeline.COLOURS["memcpy h2d"][i:i + 2], 16) for i in (1, 3, 5))
    assert (pixels.reshape(-1, 3) == h2d).all(axis=1).sum() > 100, "copy slices are visible in their colour"


def test_steps_option_and_bad_input(gpu_html, tmp_path):
    source = tmp_path / "gpu.json.gz"
    out, summary = timeline.run(str(source), str(tmp_path / "two.html"), "1:3")
    assert summary.startswith("2 steps, 2 tokens") and "steps 1:3" in out.read_text()
    with pytest.raises(ValueError, match="--steps"):
        trace_summary.parse_steps("x:y")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable trace"):
        trace_summary.load(tmp_path / "bad.json")
