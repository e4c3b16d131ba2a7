"""Flag types and the checks of flag values, where they enter: each error names the flag and its limit."""
from __future__ import annotations

import argparse
import re
import sys
import textwrap

NO_GPU_NOTICE = "kestrel-stream: no GPU found; using the CPU engine (details: --verbose)"


class UsageError(Exception):
    """A flag value that the parser accepted but this model or this command cannot use (exit status 2)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where there is none to show (None, a switch's False) or the help
    text already says it; a description of several lines (the examples) is kept as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return textwrap.fill(" ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _split_lines(self, text, width):
        # flags and paths (--max-seq-len, kestrel-stream) stay whole
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):
        text = action.help or ""
        # by identity: a default of 0 or 0.0 (--seed, --temp) equals False but is a value worth showing
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def int_at_least(minimum: int):
    """An argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def number_in(low: float, high: float, low_open: bool = False):
    """An argparse type: a finite number in low..high (above low when low_open)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            where = f"({low:g}, {high:g}]" if low_open else f"{low:g}..{high:g}"
            raise argparse.ArgumentTypeError(f"must be in {where}, got {text}")
        return value
    return parse


def new_tokens_arg(text: str) -> int:
    """An argparse type: tokens to generate, >= 1, or -1 for "until the end of generation" (llama.cpp's -n -1),
    which the command bounds by the room left in the session."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, or -1 (until the end of generation), got {value}")
    return value


def seed_arg(text: str) -> int | None:
    """An argparse type: a seed in 0..2**64-1, or -1 for a random one (llama.cpp's -s -1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value == -1:
        return None
    if not 0 <= value < 2 ** 64:
        raise argparse.ArgumentTypeError(f"must be in 0..2**64-1 (or -1: random), got {value}")
    return value


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def escaped(text: str) -> str:
    r"""An argparse type: text with \n, \t, \r and \\ read as escapes, as llama.cpp reads them (a shell
    passes `--stop "\n\n"` as backslash-n twice); any other backslash stays as written."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    value = "".join(out)
    if not value:
        raise argparse.ArgumentTypeError("expected a non-empty string")
    return value


def mode_arg(text: str) -> str:
    """An argparse type: auto|cpu|gated|gpu|offload|layers=N|layers=N+head, canonical."""
    from kestrel_stream.errors import DeviceError
    from kestrel_stream.run.engine import parse_mode
    try:
        return parse_mode(text)
    except DeviceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_ids(text: str) -> list[int]:
    """An argparse type: comma-separated token ids.  Range checks need the model: the engine makes them."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("empty prompt")
    return ids


_IDS = re.compile(r"-\d[\d,\s-]*")


def join_negative_ids(argv: list[str]) -> list[str]:
    """`--prompt-ids -1,2` as `--prompt-ids=-1,2`: argparse takes a value starting with '-' for an option
    unless it is one plain negative number, so the out-of-range id would never reach the check."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--prompt-ids" and _IDS.fullmatch(arg):
            out[-1] = f"--prompt-ids={arg}"
        else:
            out.append(arg)
    return out


def resolve_model_arg(args) -> None:
    """--model (and --hf-file) as a local path: a Hub name is fetched here, or found in the cache."""
    from kestrel_stream.loading.hub import resolve_model
    args.model = str(resolve_model(args.model, getattr(args, "hf_file", None), progress=bars_shown()))
    args.hf_file = None


def check_model_flags(args):
    """The model's config (read without loading weights), after checking the flags it limits.

    Raises FileNotFoundError / ConfigError for a bad --model before anything else is printed."""
    from kestrel_stream.cli.plan import read_config
    cfg = read_config(args.model)
    limit = cfg.max_position_embeddings
    if getattr(args, "max_seq_len", None) is not None and args.max_seq_len > limit:
        raise UsageError(f"--max-seq-len {args.max_seq_len} exceeds this model's context of {limit} positions "
                         f"(max_position_embeddings of {args.model}); give at most {limit}")
    return cfg


def check_room(engine, prompt_len: int, new_tokens: int, flag: str) -> None:
    """Generating `new_tokens` after a `prompt_len`-token prompt feeds prompt_len + new_tokens - 1 positions."""
    need = prompt_len + max(new_tokens - 1, 0)
    have, limit = engine.max_seq_len, engine.config.max_position_embeddings
    if need <= have:
        return
    if have < limit:
        hint = f"raise --max-seq-len (now {have}; this model allows up to {limit})"
    else:
        hint = f"{have} is this model's whole context (max_position_embeddings)"
    raise UsageError(f"{flag}: a {prompt_len}-token prompt and {new_tokens} new tokens need {need} positions, "
                     f"more than a session's {have}; {hint}")


def choose_device(args) -> tuple[str, str]:
    """(device, mode) for --device/--mode here; one line on stderr when `auto` falls back to the CPU engine
    (with --verbose: why there is no GPU)."""
    from kestrel_stream.run.engine import gpu_status, resolve_device
    mode = getattr(args, "mode", "auto")
    device, mode_used = resolve_device(args.device, mode, announce=False)
    if device == "cpu" and args.device == "auto" and mode == "auto":
        if getattr(args, "verbose", False):
            print(f"kestrel-stream: no GPU found ({gpu_status()[1]}); using the CPU engine", file=sys.stderr)
        else:
            print(NO_GPU_NOTICE, file=sys.stderr)
    return device, mode_used


def bars_shown() -> bool:
    """Progress bars (loads, conversions, downloads, bench runs) only where a person watches: stderr a terminal,
    not a pipe or a log file."""
    return sys.stderr.isatty()


def enable_verbose_logs() -> None:
    """--verbose: kestrel-stream's info messages (cache hits, loads) on stderr."""
    import logging
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kestrel-stream: %(message)s"))
    logger = logging.getLogger("kestrel_stream")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
