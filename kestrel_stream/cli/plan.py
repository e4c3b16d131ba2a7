"""``kestrel-stream plan`` and ``calibrate``: how a step would run here, and the figures the gate uses."""
from __future__ import annotations

import json
from pathlib import Path


def read_config(path: str, gguf_blocks: str = "native"):
    """The ModelConfig of a checkpoint directory or .gguf file, without loading weights (a GGUF's with the
    block formats its weights will load in)."""
    from kestrel_stream.model.config import ModelConfig
    p = Path(path)
    if p.is_dir():
        return ModelConfig.from_file(p / "config.json")
    if p.suffix == ".gguf" and p.is_file():
        import dataclasses
        from kestrel_stream.loading.gguf import config_from_metadata, open_gguf, planned_weight_formats
        f = open_gguf(p)
        cfg = config_from_metadata(f)
        return dataclasses.replace(cfg, weight_formats=planned_weight_formats(f, cfg)) \
            if gguf_blocks == "native" else cfg
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    raise FileNotFoundError(f"{path}: not a checkpoint directory or .gguf file")


def resolve_profile(name: str | None):
    """(DeviceProfile or None, note): --profile h200|seed|FILE, else this machine's calibrated one."""
    import scheduler
    if name == "h200":
        return scheduler.H200_MEASURED, "profile: H200 reference figures"
    if name == "seed":
        return scheduler.SEED_LIKE, "profile: seed-like machine (100 us round trip)"
    if name:
        from scheduler.profile import DeviceProfile
        return DeviceProfile.from_dict(json.loads(Path(name).read_text()), where=name), f"profile: {name}"
    from kestrel_stream.run.engine import gpu_status
    if not gpu_status()[0]:
        return None, "profile: no GPU here; gated and gpu plans use the H200 reference figures (--profile)"
    from kestrel_stream.run.calibrate import calibrate
    profile = calibrate()
    return profile, f"profile: {profile.name}, driver {profile.driver} (calibrated, cached)"


def cmd_plan(args) -> int:
    import scheduler
    cfg = read_config(args.model, args.gguf_blocks)
    profile, note = resolve_profile(args.profile)
    gpu_here = profile is not None            # calibrated here, or a profile given by --profile
    if profile is None and args.mode not in ("auto", "cpu"):
        profile = scheduler.H200_MEASURED
    from kestrel_stream.options import Options
    placement = memory = None
    if args.mode == "offload":
        placement, memory = offload_placement(cfg, args, profile)
    resident = memory.experts.experts if memory is not None and memory.experts is not None else None
    plan = scheduler.build_plan(cfg, tokens=args.batch, mode=args.mode, profile=profile, gpu_available=gpu_here,
                                minflop=Options.from_env().minflop, offload=placement, resident_experts=resident)
    scheduler.audit_plan(plan, cfg)
    window = window_report(cfg, args, memory) if args.vram_budget else None
    speculation = speculation_report(cfg, args, profile or scheduler.H200_MEASURED, gpu_here,
                                     offload_for(cfg, profile, memory) if memory is not None else None)
    if args.json:
        print(json.dumps(dict(plan.to_dict(), profile_note=note, window=window, speculation=speculation)))
    else:
        print(note)
        print(plan.describe())
        if window:
            print(window["text"])
        if speculation:
            print(speculation["text"])
    return 0


def offload_placement(cfg, args, profile):
    """(Mode offload's placement for steps of --batch tokens, its memory plan) under --vram-budget (the
    executor's own split); each step size's line goes to stderr: the placement and its predicted step for 1,
    4, 16, 64 tokens."""
    import sys
    from scheduler import offload
    from kestrel_stream.options import Options
    from kestrel_stream.run import host_memory
    from kestrel_stream.run.device.budget import parse_vram_budget, plan_offload_memory
    from kestrel_stream.run.compat import DEFAULT_MAX_SESSIONS
    if not args.vram_budget:
        raise ValueError("plan --mode offload needs --vram-budget SIZE (what the weights do not fit)")
    budget = parse_vram_budget(args.vram_budget)
    if isinstance(budget, float):
        raise ValueError("plan --mode offload: give --vram-budget as a size such as 2GiB")
    if not getattr(profile, "host_joint_GBps", None):
        profile = scheduler_pool()
        print(f"offload: no measured host memory pool in the profile; the H200 pool figures "
              f"({profile.name}) price the placement", file=sys.stderr)
    max_seq_len = args.max_seq_len or min(2048, cfg.max_position_embeddings)
    options = Options.from_env()          # the experts' ring as the engine would build it here: its host memory
    memory = plan_offload_memory(cfg, budget_bytes=budget, free_bytes=budget, profile=profile,
                                 max_tokens=max(args.max_batch, 64), max_sessions=args.max_sessions or
                                 DEFAULT_MAX_SESSIONS, max_seq_len=max_seq_len, attention_splits=16,
                                 max_batch=args.max_batch, stream_experts=options.stream_experts,
                                 host_available_bytes=host_memory.available_bytes()
                                 if options.stream_experts != "off" else None, host_reserve=options.host_reserve)
    if memory.expert_ring_left_out:
        print(memory.expert_ring_left_out, file=sys.stderr)
    for tokens in sorted({1, 4, 16, 64, args.batch}):
        print(offload.place_for_tokens(memory.placement, cfg, profile, tokens).describe(), file=sys.stderr)
    if memory.experts is not None:            # the experts the room left keeps resident (none counted yet)
        print(memory.experts.describe(cfg.num_experts), file=sys.stderr)
    return offload.place_for_tokens(memory.placement, cfg, profile, args.batch), memory


def offload_for(cfg, profile, memory):
    """Mode offload's placement for a step of n tokens (a function of n), from its memory plan."""
    from scheduler import offload
    pool = profile if getattr(profile, "host_joint_GBps", None) else scheduler_pool()
    return lambda tokens: offload.place_for_tokens(memory.placement, cfg, pool, tokens)


def scheduler_pool():
    from scheduler.profile import H200_POOL
    return H200_POOL


SPEC_CURVE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
SPEC_EXAMPLE_ACCEPTANCE = 0.8


def speculation_report(cfg, args, profile, gpu_here: bool, placement_for=None) -> dict | None:
    """With -md / --spec: the pass-time curve the cost model predicts for this placement, and the draft length
    it would choose at batch 1 and SPEC_EXAMPLE_ACCEPTANCE (the engine measures its own curve on first use).
    placement_for: mode offload's placement for a step of n tokens (offload_for)."""
    if not (args.model_draft or args.spec):
        return None
    import scheduler
    from kestrel_stream.options import Options
    from kestrel_stream.spec.cost import PassCurve, choose_draft_length

    def step_s(config, tokens: int, mode: str) -> float:
        if mode == "offload":       # the placement's own prediction, as its lines on stderr say
            return placement_for(tokens).predicted.total_us * 1e-6
        plan = scheduler.build_plan(config, tokens=tokens, mode=mode, profile=profile, gpu_available=gpu_here,
                                    minflop=Options.from_env().minflop)
        return plan.predicted_step_us(profile) * 1e-6
    curve = PassCurve(SPEC_CURVE_TOKENS, tuple(step_s(cfg, n, args.mode) for n in SPEC_CURVE_TOKENS))
    if args.model_draft:
        draft_cfg = read_config(args.model_draft, args.gguf_blocks)
        if draft_cfg.vocab_size != cfg.vocab_size:
            what = (f"draft model {args.model_draft}: vocabulary of {draft_cfg.vocab_size} tokens, the model's is "
                    f"{cfg.vocab_size}; ks.load compares the tokenizers and refuses a draft that differs")
        else:
            what = f"draft model {args.model_draft} ({draft_cfg.arch}, {draft_cfg.num_hidden_layers} layers)"
        draft_s = step_s(draft_cfg, 1, "gpu" if gpu_here else "cpu")
    else:
        what, draft_s = "prompt lookup", 0.0
    k = choose_draft_length(curve, SPEC_EXAMPLE_ACCEPTANCE, args.draft_max, 1, draft_s)
    text = (f"speculation: {what}, chains of up to {args.draft_max}, policy {args.spec_policy}; predicted "
            f"{curve.describe()}; drafting {draft_s * 1e3:.3g} ms a token; at batch 1 and "
            f"{SPEC_EXAMPLE_ACCEPTANCE:.0%} acceptance a round drafts {k} tokens"
            + (" (speculation off)" if k == 0 else ""))
    return {"text": text, "pass_curve": curve.as_dict(), "draft_s_per_token": draft_s,
            "draft_length_at_batch_1": k}


def link_share_report(cfg) -> dict:
    """Mode offload's link share as this environment sets it (KESTREL_LINK_EXPERTS, KESTREL_HOST_READS_IMAGES):
    its count and the pinned images it builds at load (every routed layer's experts, where the host's memory
    holds them beside its reserve), whether the host reads its experts there or keeps its own copies."""
    from kestrel_stream.options import Options
    from kestrel_stream.run.device.expert_pool import layer_slot_bytes
    options = Options.from_env()
    count = "auto" if options.link_experts is None else options.link_experts     # None: the default, auto
    routed = sum(1 for i in range(cfg.num_hidden_layers) if cfg.moe_layer(i))
    image_bytes = 0 if count in (0, "defer") else routed * layer_slot_bytes(cfg)
    text = ("link share: off (KESTREL_LINK_EXPERTS=0)" if count == 0 else
            "link share: defer (the resident experts run during the host's own; no images)" if count == "defer" else
            f"link share: {count} of a token's host-side choices over PCIe (KESTREL_LINK_EXPERTS); pinned host "
            f"images {image_bytes / 1e6:.1f} MB at load where the host's memory holds them, "
            + ("which the host's experts read in place" if options.host_reads_images else
               "beside the host's own copies of its experts (KESTREL_HOST_READS_IMAGES=1: read in place)"))
    return {"count": count, "image_bytes": image_bytes, "host_reads_images": options.host_reads_images, "text": text}


def window_report(cfg, args, memory=None) -> dict:
    """How `gpu` mode splits --vram-budget (the executor's own split), or mode offload's `memory` plan where
    given: the arena with the resident weights, what streams per step, and the KV pool's limit."""
    from kestrel_stream.run.device.budget import parse_vram_budget, plan_gpu_memory
    from kestrel_stream.run.compat import DEFAULT_MAX_SESSIONS
    budget = parse_vram_budget(args.vram_budget)
    max_seq_len = args.max_seq_len or min(2048, cfg.max_position_embeddings)
    if memory is not None:                    # mode offload: its window and pool (kv_dtype f16)
        report = _memory_report(memory, budget, max_seq_len, "f16")
        report["text"] = memory.window.describe() + "\n" + report["text"]
        report.update(resident_bytes=memory.window.resident_bytes,
                      streamed_bytes_per_step=memory.window.streamed_bytes_per_step)
        if cfg.is_moe:                        # the experts' ring: its VRAM and its pinned host images
            placement = memory.placement
            report["expert_ring"] = {"slots": memory.expert_ring_slots, "slot_bytes": placement.expert_slot_bytes,
                                     "image_bytes": placement.expert_image_bytes,
                                     "left_out": memory.expert_ring_left_out or None}
            report["text"] += "\n" + (
                f"experts' ring: {memory.expert_ring_slots} x {placement.expert_slot_bytes / 1e6:.1f} MB of VRAM, "
                f"pinned host images {placement.expert_image_bytes / 1e6:.1f} MB (built at load)"
                if memory.expert_ring_slots else
                f"experts' ring: none ({memory.expert_ring_left_out or 'KESTREL_STREAM_EXPERTS, or the cost model'})")
            if not memory.expert_ring_slots:
                report["link_share"] = link_share_report(cfg)
                report["text"] += "\n" + report["link_share"].pop("text")
        return report
    if isinstance(budget, float):
        from kestrel_stream.run.engine import gpu_status
        if not gpu_status()[0]:
            raise ValueError("--vram-budget: a fraction of free VRAM needs a GPU here; give a size such as 2GiB")
        from kestrel_stream.cuda import driver
        budget = int(budget * driver.Device(0).free_bytes())
    memory = plan_gpu_memory(cfg, budget_bytes=budget, free_bytes=budget, max_tokens=max(args.max_batch, 64),
                             max_sessions=args.max_sessions or DEFAULT_MAX_SESSIONS, max_seq_len=max_seq_len,
                             attention_splits=16, max_batch=args.max_batch, kv_dtype=args.kv_dtype)
    needs, window = memory.needs, memory.window
    report = _memory_report(memory, budget, max_seq_len, args.kv_dtype)
    kv_text = report.pop("text")
    if window is None:
        report["text"] = (f"window: every weight resident; arena {memory.arena_bytes / 1e6:.1f} MB of the "
                          f"{budget / 1e6:.1f} MB budget")
        report.update(resident_bytes=memory.arena_bytes - needs.activation_bytes - needs.slack_bytes,
                      streamed_bytes_per_step=0)
    else:
        report["text"] = window.describe()
        report.update(resident_bytes=window.resident_bytes, streamed_bytes_per_step=window.streamed_bytes_per_step,
                      slots=window.to_dict().get("slot_count"))
    report["text"] += "\n" + kv_text
    return report


def _memory_report(memory, budget: int, max_seq_len: int, kv_dtype: str) -> dict:
    """The arena, activations and KV pool of a memory plan; "text": the KV pool's line."""
    needs, kv = memory.needs, memory.kv
    return {"budget_bytes": budget, "arena_bytes": memory.arena_bytes,
            "activation_bytes": needs.activation_bytes + needs.slack_bytes,
            "kv_pool": {"kv_dtype": kv_dtype, "block_size": kv.block_size, "block_bytes": kv.block_bytes,
                        "max_blocks": kv.max_blocks, "max_bytes": kv.max_bytes, "max_positions": kv.max_positions,
                        "policy": kv.policy, "sessions_of_max_seq_len": kv.max_positions // max_seq_len},
            "kv_bytes": kv.max_bytes,
            "text": kv.describe() + f"; {kv.max_positions // max_seq_len} session(s) of {max_seq_len}"}


def cmd_calibrate(args) -> int:
    from kestrel_stream.run.engine import gpu_status
    from kestrel_stream.run.calibrate import calibrate, measure_host
    available, reason = gpu_status()
    if not available:
        why = f" ({reason})" if args.verbose else " (details: --verbose)"
        print(f"no GPU found{why}; host figures only:")
        print(json.dumps(measure_host(), indent=2))
        return 0
    profile = calibrate(force=True)
    print(json.dumps(profile.to_dict(), indent=2))
    return 0
