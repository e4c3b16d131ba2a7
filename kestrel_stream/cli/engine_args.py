"""The flags of every verb that loads a model, and loading it: one place, so generate, chat, serve and bench
take the same --model names, devices, budgets and threads."""
from __future__ import annotations

import argparse
import sys

from kestrel_stream.cli.args import (HelpFormatter, bars_shown, check_model_flags, choose_device, enable_verbose_logs,
                                     int_at_least, mode_arg, resolve_model_arg)

MODEL_HELP = ("a Hugging Face checkpoint directory, a .gguf file, or a model on the Hugging Face Hub: org/repo "
              "(safetensors), org/repo:Q4_K_M or org/repo:FILE.gguf (a GGUF), downloaded once into its cache; "
              "a local path wins")


class Parser(argparse.ArgumentParser):
    """argparse with defaults in --help; the verbs' parsers are of this class too."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)


def tuning_group(p: argparse.ArgumentParser):
    return p.add_argument_group("tuning and diagnostics", "the defaults suit most uses")


def progress_bar(desc: str):
    """A load-progress callback (bytes done of total) that shows a bar only when loading takes a moment."""
    from tqdm import tqdm
    bar = None

    def update(done: int, total: int, what: str = "") -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=0.5, file=sys.stderr,
                       leave=False, disable=not bars_shown())
        if what:
            bar.set_postfix_str(what[-40:], refresh=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return update


def vram_budget_arg(text: str):
    from kestrel_stream.run.device.budget import parse_vram_budget
    try:
        return parse_vram_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser, tuning) -> None:
    """The flags of every verb that loads a model; the everyday ones on `p`, the rest under `tuning`."""
    from kestrel_stream.run.engine import DEFAULT_MAX_SEQ_LEN
    p.add_argument("-m", "--model", "-hf", required=True, metavar="MODEL", help=MODEL_HELP)
    p.add_argument("-hff", "--hf-file", default=None, metavar="FILE",
                   help="the GGUF file of a --model org/repo to load (as org/repo:FILE)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: the GPU when there is one, else the CPU engine")
    p.add_argument("--mode", default="auto", type=mode_arg,
                   help="auto|cpu|gated|gpu|offload|layers=N|layers=N+head: where each op runs (auto: gpu with a GPU, cpu without; gpu short of VRAM becomes offload where host layers beside the streaming ring win)")
    p.add_argument("--vram-budget", default=None, type=vram_budget_arg,
                   help="device memory for gpu mode (weights + KV caches + activations): e.g. 2GiB, 1500MB, "
                        "0.5 (fraction of free VRAM); weights that do not fit stream over PCIe "
                        "(default: free VRAM minus a margin)")
    p.add_argument("-c", "--max-seq-len", type=int_at_least(1), default=None, metavar="N",
                   help=f"KV positions per session: prompt + generated tokens (default: {DEFAULT_MAX_SEQ_LEN}, "
                        f"or the model's max_position_embeddings when smaller, e.g. 512 for the tiny preset)")
    p.add_argument("-t", "--cpu-threads", type=int_at_least(1), default=None, metavar="N",
                   help="the host's threads: the native host kernels' and BLAS's (default: one per physical core; 1 is "
                        "faster for short steps where other processes share the cores)")
    p.add_argument("--verbose", action="store_true", help="say why there is no GPU, and log loads and caches")
    tuning.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"],
                        help="gpu mode's KV cache: f16 (default) or f32 (the reference arithmetic)")
    tuning.add_argument("--gguf-blocks", default="native", choices=["native", "q8_0"],
                        help="a GGUF's Q4_0 / Q4_K / Q6_K tensors: run in their blocks (native, default) or "
                             "converted to Q8_0 at load")
    tuning.add_argument("--no-cache", action="store_true", help="do not read or write the quantized cache")
    tuning.add_argument("--prof", action="store_true",
                        help="print the per-stage profile table of offloaded calls at exit (as KESTREL_PROF=1)")
    tuning.add_argument("--trace", default=None, metavar="FILE",
                        help="record a Chrome trace (.json or .json.gz; view with `timeline` or Perfetto)")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding's flags (generate, chat), as llama.cpp names them."""
    from kestrel_stream.spec.speculation import DEFAULT_DRAFT_MAX, POLICIES, SPEC_KINDS
    g = p.add_argument_group("speculative decoding", "a draft proposes tokens, the model verifies them many a "
                             "step; greedy output is the same as without, sampled output of the same distribution")
    draft = g.add_mutually_exclusive_group()
    draft.add_argument("-md", "--model-draft", default=None, metavar="MODEL",
                       help="a small model of the same tokenizer drafting for --model (a path or hub name, as "
                            "--model); loaded on the same device, all resident, inside --vram-budget")
    draft.add_argument("--spec", default=None, choices=SPEC_KINDS,
                       help="lookup: drafts copied from earlier in the prompt and the output (no model)")
    g.add_argument("--draft-max", type=int_at_least(1), default=DEFAULT_DRAFT_MAX, metavar="N",
                   help="the longest drafted chain")
    g.add_argument("--spec-policy", default="auto", choices=POLICIES,
                   help="auto: each round's draft length from the model's measured pass times (1, 2, 4, ... "
                        "tokens), the acceptance and the batch, none where drafting would not pay; always: "
                        "draft every round, the length following the acceptance alone")


def prepare_engine(args) -> None:
    """Check --model and the flags it limits, then pick the device (the one no-GPU notice is printed here):
    args.device and args.mode become what will run, so ks.load announces nothing more."""
    if args.verbose:
        enable_verbose_logs()
    resolve_model_arg(args)
    check_model_flags(args)
    args.device, args.mode = choose_device(args)


def load_engine(args):
    import kestrel_stream as ks
    prepare_engine(args)
    if getattr(args, "prof", False):
        from kestrel_stream.obs import prof
        prof.enable()
    if getattr(args, "trace", None):
        from kestrel_stream.obs import trace
        trace.start(args.trace, command=args.command)
    return ks.load(args.model, device=args.device, mode=args.mode, vram_budget=args.vram_budget,
                   max_seq_len=args.max_seq_len, cache=not args.no_cache, progress=progress_bar("loading"),
                   kv_dtype=args.kv_dtype, cpu_threads=args.cpu_threads,
                   gguf_blocks=args.gguf_blocks, draft=getattr(args, "model_draft", None),
                   spec=getattr(args, "spec", None), draft_max=getattr(args, "draft_max", 8),
                   spec_policy=getattr(args, "spec_policy", "auto"))
