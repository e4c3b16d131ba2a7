"""`serve --help` under headings: the everyday flags first, then tuning, then limits.

The flags are serve's own (serve/flags.py and the functions it calls); this
only sorts them into argparse groups as they are added.  A flag named in
neither set below is a limit: that is what serve's flags are, apart from the
few a person sets every day and the scheduler's knobs.
"""
from __future__ import annotations

EVERYDAY = frozenset({"--socket", "--tcp", "--devices", "--token", "--token-file", "--http", "--api-key", "--api-key-file",
                      "--served-model-name", "--max-sessions", "--max-queue", "--no-access-log", "--temp", "--top-k", "--top-p",
                      "--min-p", "--repeat-penalty", "--presence-penalty", "--frequency-penalty", "--max-tokens"})
TUNING = frozenset({"--route-prefix-slack", "--trace-dir", "--prefix-cache-positions", "--max-batch", "--batch-window-ms", "--step-tokens",
                    "--inline-max-ms", "--spin-us"})


class SortedFlags:
    """Stands for the parser while serve adds its flags: each lands in its heading's group."""

    def __init__(self, everyday, tuning, limits):
        self.everyday, self.tuning, self.limits = everyday, tuning, limits

    def add_argument(self, *names, **kwargs):
        return self.group_of(names).add_argument(*names, **kwargs)

    def add_mutually_exclusive_group(self, **kwargs):
        return self.everyday.add_mutually_exclusive_group(**kwargs)      # where to listen: --socket | --tcp

    def group_of(self, names):
        if EVERYDAY.intersection(names):
            return self.everyday
        return self.tuning if TUNING.intersection(names) else self.limits


def sorted_flags(parser, tuning) -> SortedFlags:
    limits = parser.add_argument_group("limits", "what one client may hold of the daemon, and HTTP's limits")
    return SortedFlags(parser, tuning, limits)
