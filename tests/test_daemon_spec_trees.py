"""`kestrel-stream serve --spec lookup` as a process: clients at once over the socket, their rounds' token trees
verified in shared steps, each answer a greedy path of its prompt, the trees in stats and no session left."""
from __future__ import annotations

from daemon_helpers import assert_greedy_path, run_clients
from test_spec_serve_trees import LOOKUP_IDS

import kestrel_stream as ks

DAEMON_FLAGS = ("--spec", "lookup", "--spec-policy", "always")
PROMPTS = (LOOKUP_IDS, LOOKUP_IDS[3:], [9, 8, 7, 9, 8, 6, 9, 8, 5, 9, 8], LOOKUP_IDS + [217, 20])
NEW_TOKENS = 40


def test_clients_at_once_get_greedy_paths_from_verified_trees(daemon, daemon_engine):
    answers = {}

    async def one_client(i: int) -> None:
        async with ks.AsyncClient(daemon.address) as client:
            answers[i] = await client.generate(PROMPTS[i % len(PROMPTS)], NEW_TOKENS)
    stats = run_clients(daemon.address, 8, one_client)
    for i, answer in answers.items():
        assert len(answer.tokens) == NEW_TOKENS
        # the process runs the native kernels: a tree's step and a plain one agree up to near ties
        assert_greedy_path(daemon_engine, PROMPTS[i % len(PROMPTS)], answer.tokens)
        assert answer.speculation["spec_passes"] < NEW_TOKENS - 1
    spec = stats["speculation"]
    assert spec["kind"] == "lookup" and spec["spec_drafted"] >= spec["spec_accepted"] > 0
    assert spec["spec_tree_nodes"] > spec["spec_draft_length"] + 1       # trees, not chains
    assert spec["spec_passes"] == sum(a.speculation["spec_passes"] for a in answers.values())
    assert stats["sessions"] == 0 and stats["step_errors"] == 0
