"""A mixed step as one graph with host items (run/mixed.py's MixedSteps; host_nodes.py): from the step's
first device segment on, its launches, the copies between the sides and each host segment's op list handed
to the host library's thread by pinned words, with one wait a step -- where segment by segment the host
waits once a host segment.  A (tokens, lm rows) runs segment by segment the first time, is captured the
second, replayed after.  Only where every host segment after the first device one is a native op list over
the pinned state (NativeProgram.node: no embed, no sessions' caches), at least one (or none in a step that
streams through the weight ring: its copies take no other graph), in a step that takes
graphs as a segment does (at most SEGMENT_GRAPH_MAX_TOKENS tokens, no experts streamed through the experts'
ring, no tree, untraced).  Mode offload's weight ring goes in whole: its copies start where the graph does,
on the copy stream the capture joins by the ring's events (device/stream_ring.py), so a replay streams the
step's items into their slots while the host items run, with no host thread between them
(KESTREL_RING_GRAPHS=0: such steps segment by segment).

In a step of a few tokens, a routed layer's host item may come with its link share (device/expert_link.py):
the device computes some of the experts the host would from pinned images while the item runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import scheduler
from kestrel_stream.obs import prof, trace
from kestrel_stream.run.host_nodes import ITEM_PROGRAM

if TYPE_CHECKING:
    from kestrel_stream.run.segment_state import SegmentState

SEGMENT_GRAPH_MAX_TOKENS = 64        # larger mixed steps (a prefill's chunks, of many sizes) launch eagerly (mixed.py)
# counters a replay does not add from its capture: its one sync and its replay are counted as they happen,
# the host items' weight bytes by the experts each one ran
NOT_REPLAYED = ("syncs", "graph_replays", "graphs_captured", "cpu_weight_read_bytes", "steps", "tokens")


class ItemGraphs:
    def __init__(self, steps, nodes, link=None, ring_steps: bool = True):
        """steps: the MixedSteps; nodes: its HostNodes (None: no graphs); link: the routed layers' link share
        (closed here where there are no graphs to run it); ring_steps: steps streaming through the weight ring too
        (KESTREL_RING_GRAPHS)."""
        self.steps, self.nodes, self.ring_steps = steps, nodes, ring_steps
        self.link = link if nodes is not None else None
        if link is not None and self.link is None:
            link.close()
        self._graphs: dict = {}          # (tokens, lm rows, pick) -> (graph, counters a replay adds, program
                                         # nodes, the item list, the link specs armed per replay, the ring's bytes,
                                         # whether the tokens came back in place of the logits)
        self._starts: dict = {}          # tokens -> the segment its graph starts at, or None: no graph
        self._seen: set = set()
        self._done = None                # the blocking event a replay's host waits on
        self.deferrals = 0               # device experts ops captured to run during their host item (defer)

    def start(self, plan, state: SegmentState) -> int | None:
        """The segment a step's graph starts at (its first device segment; the host work before it runs
        eagerly), or None: segment by segment."""
        s = self.steps
        if (self.nodes is None or not s.use_graphs or s.streams_experts()
                or (s.ring is not None and not self.ring_steps) or prof.enabled or trace.active is not None
                or state.tree_fields is not None or state.T > SEGMENT_GRAPH_MAX_TOKENS):
            return None
        if state.T not in self._starts:
            segments = plan.segments
            first = next((i for i, segment in enumerate(segments) if segment.side == "gpu"), len(segments))
            hosts = [i for i in range(first + 1, len(segments)) if segments[i].side == "cpu"]

            def native(i: int) -> bool:
                one_call = s._host_program(state.T, i, segments[i])[1].one_call
                return one_call is not None and one_call.node(state) is not None
            # a step with no host segment after its first device one takes a graph for its ring's copies
            self._starts[state.T] = (first if (hosts or s.ring is not None) and all(native(i) for i in hosts)
                                     else None)
        return self._starts[state.T]

    def run(self, plan, state: SegmentState, lm: tuple[int, int] | None, first: int, begin) -> None:
        """Segments first.. and the logits' download: segment by segment, captured, or replayed.  begin(): the
        weight ring's first copies (mode offload), issued where the segments start, so a capture holds the
        step's every copy into the ring and a replay makes them.  A replay adds the counters its capture
        counted (the same launches and copies); the host items' weight bytes and failures are read after the
        wait."""
        from kestrel_stream.cuda import driver
        s = self.steps
        key, c, stream = (state.T, lm, state.pick and state.pick[0]), s.counters, s.backend.stream
        made = self._graphs.get(key)
        if made is None and key not in self._seen:
            self._seen.add(key)                    # a size seen once (a prompt's last chunk) costs no capture
            begin()
            s._run_segments(plan, state, lm, first)
            state.outputs_to_host()
            return
        if made is None:
            before = c.as_dict()
            nodes: list = []
            state.graphing = True
            with driver.capture(stream) as captured:
                begin()
                s._run_segments(plan, state, lm, first, None, nodes)
                state.outputs_to_host()
            state.graphing = False
            added = {name: value - before.get(name, 0) for name, value in c.as_dict().items()
                     if name not in NOT_REPLAYED and value != before.get(name, 0)}
            streamed = s.ring.bytes_per_step if s.ring is not None else 0
            made = self._graphs[key] = (captured.graph, added, nodes, self.nodes.item_list(state.items),
                                        list(state.links), streamed, state.picked)
            c.graphs_captured = (c.graphs_captured or 0) + 1
        else:
            for name, value in made[1].items():
                setattr(c, name, getattr(c, name) + value)
            if s.ring is not None:                 # what the replay's copies bring (counted by the caller)
                s.ring.bytes_per_step = made[5]
            state.picked = made[6]                 # the tokens came back in place of the logits
        if self._done is None:                 # the host's wait sleeps: the library's thread and pool need the cores
            self._done = driver.Event(name="step graph done", blocking=True)
        if made[4]:                            # the link shares run only inside the graph, as its items
            self.link.arm(made[4], state.T)
        serves = bool(made[3][2])              # host items for the library's thread (none: the ring's alone)
        if serves:
            self.nodes.begin(made[3])
        try:
            made[0].launch(stream)
            self._done.record(stream)
            self._done.synchronize()
        except BaseException:
            if serves:
                self.nodes.end(aborted=True)
            raise
        finally:
            if made[4]:
                self.link.disarm(made[4], state.T)
        missed = self.nodes.end() if serves else 0
        if missed:
            raise driver.CudaError(f"step graph: host item {-missed} of {len(made[3][2])} never had the device's word")
        c.syncs += 1
        c.graph_replays = (c.graph_replays or 0) + 1
        if made[4]:
            c.streamed_bytes = (c.streamed_bytes or 0) + sum(self.link.step_bytes(spec) for spec, _, _ in made[4])
        for native, node in made[2]:
            failed, node.status = node.status, 0
            native.count_run(state.T, failed)

    def host_item(self, plan, index: int, state: SegmentState, lm, native) -> tuple:
        """Inside a capture: host segment `index` (one native call) handed over as an item, with the next
        device segment's norm input over the x it writes made in the same hand-off (one word each way where
        two items took two), and its link share; (native, its node) for the replays' counters."""
        s = self.steps
        node = native.node(state)
        norm = self._norm_after(plan, index, state, lm) if "x" in native.outputs else None
        then = (state.norm_item(norm, s.config.rms_norm_eps),) if norm is not None else ()
        self.nodes.hand_over(state.stream, state.items, ITEM_PROGRAM, node, self.link_share(native, state), then)
        for name in native.outputs:
            state.host_wrote(name)
        if norm is not None:
            state.xn_made(norm)
        return native, node

    def _norm_after(self, plan, index: int, state: SegmentState, lm):
        """The norm whose xn the device segment after segment `index` takes from the host first (its first
        op's prologue), or None."""
        segments = plan.segments
        if index + 1 >= len(segments) or segments[index + 1].side != "gpu":
            return None
        ops = [op for op in segments[index + 1].ops if scheduler.runs_alone(op)]
        reads, prologue = self.steps._prepared_for(ops[0], state.T, lm)[:2] if ops else ((), None)
        return prologue if "xn" in reads and prologue is not None else None

    def defer(self, plan, index: int, ops: list, state: SegmentState) -> list:
        """Inside a capture, device segment `index`'s ops less the one left for later: its routed layer's
        device experts (the resident ones; the segment's last op), where the host segment after it is that
        layer's item with a link share -- they then run while the host computes its experts (link_share's
        meanwhile), their sum reaching the host before the word it waits for at its end."""
        if self.link is None or state.T > self.link.max_tokens or not ops or ops[-1].kind != "experts":
            return ops
        nxt, layer = index + 1, ops[-1].layer
        if nxt >= len(plan.segments) or plan.segments[nxt].side != "cpu" or layer not in self.link.layers:
            return ops
        native = self.steps._host_program(state.T, nxt, plan.segments[nxt])[1].one_call
        if native is None or native.node(state) is None or list(native.routed_layers) != [layer]:
            return ops
        state.deferred = ops[-1]
        self.deferrals += 1
        return ops[:-1]

    def link_share(self, native, state: SegmentState):
        """For a captured host segment whose one routed layer has a link share: its device side, enqueued while
        the host item runs (HostNodes.hand_over's meanwhile) -- the layer's device experts deferred from the
        segment before (defer), then, in a step the share takes (ExpertLink.takes), the share -- and a word
        the host waits for before adding their sums; else None."""
        if self.link is None or state.T > self.link.max_tokens:
            return None
        linked = [(layer, bound) for layer, (bound, _) in zip(native.routed_layers, native.routed)
                  if layer in self.link.layers]
        (layer, bound), s = linked[0] if len(linked) == 1 else (None, None), self.steps
        b = s.backend
        deferred, state.deferred = state.deferred, None
        assert deferred is None or deferred.layer == layer, "a device experts op deferred past its own item"
        shares = layer is not None and self.link.takes(b.kernels, layer, state.T)
        if not shares and deferred is None:
            return None
        (ready, done), words = self.nodes.link_words
        spec = self.link.spec(layer, ready, done)
        bound.share_link(spec)

        def meanwhile(item: int) -> None:
            state.links.append((spec, item, shares))
            if deferred is not None:          # the resident experts' sum, down before the word
                items = len(state.items)
                s._device_op(deferred, state)
                assert len(state.items) == items, "a deferred experts op handed an item over"
                state.to_host(["moe_out"])
            self.link.enqueue(state.stream, b.kernels, layer, state.T, item, words, b.state.moe, b.state, shares)
            if shares:
                s.counters.launches += 3                        # gate_up, down, combine
                s.counters.h2d_bytes += self.link.copy_bytes
                s.counters.d2h_bytes += 4 * s.config.hidden_size * state.T       # the sums, written over the link
        return meanwhile

    def drop(self) -> None:
        """Forget every graph (the launch lists changed)."""
        for made in self._graphs.values():
            made[0].destroy()
        self._graphs.clear()
        self._starts.clear()
        self._seen.clear()

    def close(self) -> None:
        self.drop()
        if self.link is not None:
            self.link.close()
