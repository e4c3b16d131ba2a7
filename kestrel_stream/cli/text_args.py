"""`generate`'s prompt and sampling flags, named as llama.cpp names them (one block, added to the parser)."""
from __future__ import annotations

import argparse

from kestrel_stream.cli.args import escaped, number_in, seed_arg

MAX_TEMPERATURE = 100.0
MAX_PENALTY = 100.0


def add_text_args(p: argparse.ArgumentParser, parse_ids) -> None:
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", default=None,
                        help="prompt text (the model's BOS is added where it wants one)")
    prompt.add_argument("--chat", default=None, metavar="MESSAGE",
                        help="a user message, rendered with the model's chat template")
    prompt.add_argument("--prompt-ids", default=None, type=parse_ids, help="prompt token ids: 1,2,3")
    p.add_argument("--system", default=None, help="system message for --chat")
    add_sampling_args(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling and stopping flags (generate and chat), each range checked here, before the model loads."""
    p.add_argument("--temp", type=number_in(0, MAX_TEMPERATURE), default=0.0,
                   help=f"temperature in 0..{MAX_TEMPERATURE:g}; 0 (the default) is greedy")
    p.add_argument("--top-k", type=int, default=40, help="keep the K most likely tokens (<= 0: off)")
    p.add_argument("--top-p", type=number_in(0, 1, low_open=True), default=0.95,
                   help="keep the smallest set of mass >= P, in (0, 1] (1: off)")
    p.add_argument("--min-p", type=number_in(0, 1), default=0.05,
                   help="keep tokens of probability >= P x the top one, in 0..1 (0: off)")
    p.add_argument("--repeat-penalty", type=number_in(0, MAX_PENALTY, low_open=True), default=1.0,
                   help="penalty on the last 64 tokens (1: off)")
    p.add_argument("--presence-penalty", type=number_in(-MAX_PENALTY, MAX_PENALTY), default=0.0,
                   help="subtracted once from every token already seen (0: off)")
    p.add_argument("--frequency-penalty", type=number_in(-MAX_PENALTY, MAX_PENALTY), default=0.0,
                   help="subtracted per occurrence of a token already seen (0: off)")
    p.add_argument("-s", "--seed", type=seed_arg, default=None,
                   help="sampling seed (default, or -1: random)")
    p.add_argument("--stop", nargs="+", type=escaped, default=None, metavar="STR",
                   help=r"stop when the text contains STR; \n, \t, \r and \\ are read as escapes")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-generation tokens")


def prompt_from_args(args, engine):
    if args.prompt_ids is not None:
        if args.system is not None:
            raise ValueError("--system goes with --chat")
        return args.prompt_ids
    if engine.tokenizer is None:
        raise ValueError(f"{args.model}: the model has no tokenizer (tokenizer.json or GGUF tokenizer); "
                         "use --prompt-ids")
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        return messages + [{"role": "user", "content": args.chat}]
    if args.system is not None:
        raise ValueError("--system goes with --chat")
    return args.prompt


def generate_kwargs(args) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop,
                ignore_eos=args.ignore_eos)
