"""Every setting read from the environment, in one place: this module is the only reader of os.environ.

``Options.from_env()`` reads the engine's KESTREL_* settings (and takes what
flags or ks.load arguments gave) into one frozen object when the engine is
built; the engine passes it down to the executor, the kernel set and the
planner.  ``Environment.from_env()`` reads the daemon's, the clients' and the
bench's own variables where they start (the CLI's main, ks.Client, a bench
driver), and they pass it down.  Nothing below reads the environment, and
nothing reads it at import time.  A bad value raises here, naming the variable.

    KESTREL_PROF=1            the per-stage profile table at exit (as --prof)
    KESTREL_TRACE=FILE        a Chrome trace of the whole process, written at exit (as --trace)
    KESTREL_VERIFY=1          recompute every GPU step on the host and count mismatches
    KESTREL_PDL=0             no programmatic dependent launch between a step's kernels
    KESTREL_FUSED_ROPE=0      one-token gpu steps keep a rope launch per layer (not attention's prologue)
    KESTREL_STEP_GRAPHS=0|1   a gpu step of 2..64 tokens on one session replays a graph per bucket of token
                              counts, and a gated / layers=N step's device segments (up to 64 tokens) a graph
                              each from the second step of their size (1, the default); or every kernel is
                              launched eagerly (0)
    KESTREL_HOST_NODES=0|1    a mixed step whose host segments are library calls: one graph with host items from
                              its third step of a size (1, the default; run/item_graphs.py), or segment by segment
    KESTREL_RING_GRAPHS=0|1   under KESTREL_HOST_NODES=1, mode offload's steps that stream through the weight ring
                              too, its copies in the graph (1, the default), or those segment by segment (0)
    KESTREL_MINFLOP=F         the seed's per-projection FLOP threshold instead of the cost model (gated)
    KESTREL_GEMV_M1=SUFFIX    force one single-token GEMV layout (KESTREL_GEMV_M1_ROWS=4|2: "r4" | "")
    KESTREL_GEMV_MN=SUFFIX    force one 2..8-token GEMV layout
    KESTREL_CUBLAS_MIN_TOKENS=N  gpu mode's steps of >= N tokens on cuBLAS (default 128; 0: never)
    KESTREL_GEMV_BLOCK=NAME   force one 4/6-bit GEMV layout where it fits the token count ("": the first kernel)
    KESTREL_BLOCK_MMA_MIN_TOKENS=N  4/6-bit steps of >= N tokens (2..9) on the tensor-core GEMM (default 6); set, it
                              also keeps Q4_K / Q6_K steps off the fp16 tensor-core GEMV (the older choices)
    KESTREL_MOE_MMA_MIN_TOKENS=N  routed layers' steps of >= N tokens on the grouped tensor-core GEMM
                              (default: cuda/moe_kernels.mma_min_tokens, 8 tokens per expert on average; 0: always)
    KESTREL_MOE_MMA_TILE=BMxBN   force one tile of that GEMM (cuda/moe_kernels.MMA_TILES: 16x64 | 32x64 | 64x64)
    KESTREL_MOE_GEMV=g4|m8    routed layers' steps of 2 tokens up to the GEMM on 8 experts a block (g4, the default)
                              or one expert a block in tiles of 8 tokens (m8, before)
    KESTREL_LINK_EXPERTS=N    mode offload, one token: N of a token's host-side expert choices read by the GPU
                              over PCIe while the host computes the rest (run/device/expert_link.py; default 0);
                              auto: the count measured fastest while serving (scheduler/link_tuner.py);
                              defer: none over the link, only the resident experts run during the host's
    KESTREL_HOST_READS_IMAGES=0|1  mode offload with pinned images of the experts (a link share, an experts'
                              ring): the host's native experts read their Q8_0 rows in those images (1), keeping
                              no copy of their own, or read their own split copies (0, the default until timed on
                              a GPU's host: the images may sit on small pages, the copies on huge ones)
    KESTREL_EXPERT_IMAGES=pinned|registered  how those pinned images are made: cuMemHostAlloc (pinned, the
                              default) or huge pages filled by threads, then cuMemHostRegister (registered)
    KESTREL_KERNEL_CACHE=DIR  where compiled kernels are cached
    KESTREL_CACHE_DIR=DIR     where device profiles (and preset models) are cached
    KESTREL_HOST_KERNELS=numpy  the host backend multiplies on float32 copies with numpy (the reference
                              arithmetic) instead of the native quantized kernels (default: native)
    KESTREL_HOST_ISA=NAME     the widest ISA the native host kernels use: scalar | avx2 | avxvnni | avx512vnni | amx
    KESTREL_HOST_SPIN_US=N    how long the native host kernels' idle workers poll before sleeping (default 100)
    KESTREL_BLAS_THREADS=N    numpy's BLAS threads (as ks.load's blas_threads; default: 1 on the CPU engine over the
                              native kernels, else the host's threads: run/blas_threads.engine_blas_threads)
    CC=COMPILER               the C compiler that builds the native host kernels (default: cc)
    KESTREL_OFFLOAD=WHICH     gpu mode under a VRAM budget the weights do not fit: auto (the cost model picks),
                              stream (the window alone: every non-resident weight crosses PCIe) or place
                              (mode offload: resident, streamed and host-computed layers)
    KESTREL_OFFLOAD_HOMES=H.. mode offload's layers given, a letter each (R resident, S streamed, H host,
                              M MLP on the host with qkv and o streamed, A MLP on the host with qkv and o
                              resident), then optionally :host or :resident for lm_head (benches)
    KESTREL_RESIDENT_EXPERTS=P mode offload's experts in the VRAM its layers leave: frequency (the most chosen
                              so far; default), uniform (the same number a layer, blind to the counts) or none
    KESTREL_STREAM_EXPERTS=W  mode offload's experts' ring (steps of many tokens stream a routed layer's experts
                              onto the GPU): auto (a ring where the cost model predicts the largest step gains
                              by it and the budget holds it; default), on (a ring, or refuse the budget) or off
    KESTREL_HOST_RESERVE=SIZE host memory the experts' ring's pinned images leave free (default: the host's share
                              of the model's weights + 4GiB; 0 builds them wherever MemAvailable holds them)

The daemon's, clients' and result files' variables (Environment):

    KESTREL_SOCKET=ADDRESS    the daemon a client connects to without an address (a path or tcp://HOST:PORT)
    KESTREL_TOKEN=TOKEN       the TCP token: the daemon's when no --token/--token-file, a client's when none given
    KESTREL_API_KEY=KEY       serve --http's bearer key when no --api-key/--api-key-file
    KESTREL_COMMIT=HASH       the commit a result file names (a copy of the tree without .git)
    XDG_RUNTIME_DIR=DIR       where the default socket, token and trace directory live
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

HOST_ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni", "amx")     # native.ISAS (not imported: it loads ctypes and numpy)


@dataclass(frozen=True)
class Options:
    vram_budget: int | float | None = None   # bytes, or a fraction of free VRAM (parse_vram_budget)
    prof: bool = False
    trace_path: str | None = None
    verify: bool = False
    programmatic_launch: bool = True
    fused_rope: bool = True                  # one-token gpu steps: rope as attention's prologue (ops.fuse_rope)
    step_graphs: bool = True                 # one session's steps of 2..64 tokens as graphs (device/step_graphs.py)
    host_nodes: bool = True                  # mixed steps as one graph with host nodes (run/host_nodes.py)
    ring_graphs: bool = True                 # with host_nodes: mode offload's steps with the weight ring too
    link_experts: int | str = 0              # one-token offload steps: host-side choices the GPU reads over PCIe,
                                             # "auto" (scheduler/link_tuner.py) or "defer" (none, no images)
    host_reads_images: bool = False          # the host's Q8_0 experts read in the device's pinned images
    expert_images: str = "pinned"            # those images: cuMemHostAlloc, or "registered" huge pages
    minflop: float | None = None
    gemv_m1: str | None = None               # None: the layout measured fastest for the shape
    gemv_mn: str | None = None
    cublas_min_tokens: int | None = None     # None: scheduler.dense.default_min_tokens; 0: the built-in GEMM always
    gemv_block: str | None = None            # a layout of cuda/q4_gemv_variants.py; None: choose's
    block_mma_min_tokens: int | None = None  # None: cuda/block_kernels.MMA_MIN_TOKENS
    moe_mma_min_tokens: int | None = None    # None: cuda/moe_kernels.mma_min_tokens's default
    moe_mma_tile: str | None = None          # a tile of cuda/moe_kernels.MMA_TILES; None: mma_tile's choice
    moe_gemv: str | None = None              # cuda/moe_kernels.GEMV_LAYOUTS; None: its default
    kernel_cache_dir: Path | None = None     # None: kernels_ptx.build's default
    cache_dir: Path | None = None            # None: ~/.cache/kestrel-stream
    host_isa: str | None = None              # None: the widest the CPU has (native.ISAS)
    host_cc: str | None = None               # None: cc
    host_spin_us: int | None = None          # None: the library's default (100)
    host_kernels: str = "native"             # the host backend's projections: native kernels, or numpy
    host_threads: int | None = None          # the native host kernels' threads (None: the physical cores)
    blas_threads: int | None = None          # numpy's BLAS threads (None: blas_threads.engine_blas_threads's)
    offload: str = "auto"                    # gpu mode short of VRAM: auto | stream | place (KESTREL_OFFLOAD)
    offload_homes: str | None = None         # mode offload's layers given (KESTREL_OFFLOAD_HOMES; None: chosen)
    resident_experts: str = "frequency"      # mode offload's experts in VRAM: frequency | uniform | none
    stream_experts: str = "auto"             # mode offload's experts' ring: auto | on | off (KESTREL_STREAM_EXPERTS)
    host_reserve: int | None = None          # host bytes the ring's images leave free (KESTREL_HOST_RESERVE)
    device_ordinal: int = 0                  # the GPU of a device engine (ks.load's device="cuda:N")

    @property
    def cache_root(self) -> Path:
        """Where the kernel and profile caches go: cache_dir, or default_cache_root()."""
        return self.cache_dir or default_cache_root()

    @property
    def kernel_cache(self) -> Path:
        """The compiled kernels' directory: kernel_cache_dir, or cache_root/kernels."""
        return self.kernel_cache_dir or self.cache_root / "kernels"

    @property
    def host_kernel_cache(self) -> Path:
        """The native host kernels' built libraries: cache_root/host_kernels."""
        return self.cache_root / "host_kernels"

    @classmethod
    def from_env(cls, environ=None, **given) -> "Options":
        """The environment's settings, overridden by `given` (flags, ks.load arguments)."""
        from kestrel_stream.cuda import moe_kernels, q4_gemv_variants
        from kestrel_stream.cuda.gemv_variants import HMMA_VARIANTS, MULTI_VARIANTS, VARIANTS    # (see with_)
        env = os.environ if environ is None else environ
        m1 = env.get("KESTREL_GEMV_M1")
        if m1 is None and env.get("KESTREL_GEMV_M1_ROWS"):
            m1 = {"4": "r4", "2": ""}.get(env["KESTREL_GEMV_M1_ROWS"])
        if m1 is not None and m1 not in VARIANTS:
            raise ValueError(f"KESTREL_GEMV_M1={m1!r}: not a GEMV variant; one of "
                             f"{', '.join(repr(v) for v in VARIANTS)}")
        mn = env.get("KESTREL_GEMV_MN")
        if mn is not None and mn not in MULTI_VARIANTS and mn not in HMMA_VARIANTS:
            raise ValueError(f"KESTREL_GEMV_MN={mn!r}: not a multi-token GEMV variant; one of "
                             f"{', '.join(repr(v) for v in (*MULTI_VARIANTS, *HMMA_VARIANTS))}")
        block = env.get("KESTREL_GEMV_BLOCK")
        if block is not None and block not in q4_gemv_variants.ALL_VARIANTS:
            raise ValueError(f"KESTREL_GEMV_BLOCK={block!r}: not a block-format GEMV layout; one of "
                             f"{', '.join(repr(v) for v in q4_gemv_variants.ALL_VARIANTS)}")
        block_mma = _tokens(env.get("KESTREL_BLOCK_MMA_MIN_TOKENS"), "KESTREL_BLOCK_MMA_MIN_TOKENS")
        if block_mma is not None and not 2 <= block_mma <= 9:
            raise ValueError(f"KESTREL_BLOCK_MMA_MIN_TOKENS={block_mma}: 2..9 (the GEMV layouts serve up to 8 tokens)")
        moe_mma_tile = env.get("KESTREL_MOE_MMA_TILE") or None
        if moe_mma_tile is not None and moe_mma_tile not in moe_kernels.MMA_TILES:
            raise ValueError(f"KESTREL_MOE_MMA_TILE={moe_mma_tile!r}: one of {', '.join(moe_kernels.MMA_TILES)}")
        moe_gemv = env.get("KESTREL_MOE_GEMV") or None
        if moe_gemv is not None and moe_gemv not in moe_kernels.GEMV_LAYOUTS:
            raise ValueError(f"KESTREL_MOE_GEMV={moe_gemv!r}: one of {', '.join(moe_kernels.GEMV_LAYOUTS)}")
        host_isa = env.get("KESTREL_HOST_ISA") or None
        if host_isa is not None and host_isa not in HOST_ISAS:
            raise ValueError(f"KESTREL_HOST_ISA={host_isa!r}: one of {', '.join(HOST_ISAS)}")
        host_kernels = env.get("KESTREL_HOST_KERNELS") or "native"
        if host_kernels not in ("native", "numpy"):
            raise ValueError(f"KESTREL_HOST_KERNELS={host_kernels!r}: native or numpy")
        step_graphs = env.get("KESTREL_STEP_GRAPHS", "1").strip() or "1"
        if step_graphs not in ("0", "1"):
            raise ValueError(f"KESTREL_STEP_GRAPHS={step_graphs!r}: 0 (eager launches) or 1 (graphs, the default)")
        host_nodes = env.get("KESTREL_HOST_NODES", "1").strip() or "1"
        if host_nodes not in ("0", "1"):
            raise ValueError(f"KESTREL_HOST_NODES={host_nodes!r}: 0 (a mixed step segment by segment) or 1 (the default)")
        ring_graphs = env.get("KESTREL_RING_GRAPHS", "1").strip() or "1"
        if ring_graphs not in ("0", "1"):
            raise ValueError(f"KESTREL_RING_GRAPHS={ring_graphs!r}: 0 (a step streaming through the weight ring "
                             "segment by segment) or 1 (one graph, the default)")
        host_reads_images = env.get("KESTREL_HOST_READS_IMAGES", "0").strip() or "0"
        if host_reads_images not in ("0", "1"):
            raise ValueError(f"KESTREL_HOST_READS_IMAGES={host_reads_images!r}: 0 (the host's own copies, the "
                             "default) or 1 (the experts' pinned images)")
        expert_images = env.get("KESTREL_EXPERT_IMAGES") or "pinned"
        if expert_images not in ("pinned", "registered"):
            raise ValueError(f"KESTREL_EXPERT_IMAGES={expert_images!r}: pinned (cuMemHostAlloc, the default) or "
                             "registered (huge pages, then cuMemHostRegister)")
        offload = env.get("KESTREL_OFFLOAD") or "auto"
        if offload not in OFFLOAD_CHOICES:
            raise ValueError(f"KESTREL_OFFLOAD={offload!r}: one of {', '.join(OFFLOAD_CHOICES)}")
        blas_threads = _tokens(env.get("KESTREL_BLAS_THREADS"), "KESTREL_BLAS_THREADS", "threads")
        if blas_threads == 0:
            raise ValueError("KESTREL_BLAS_THREADS=0: expected a number of threads >= 1")
        resident_experts = env.get("KESTREL_RESIDENT_EXPERTS") or "frequency"
        if resident_experts not in RESIDENT_EXPERTS:
            raise ValueError(f"KESTREL_RESIDENT_EXPERTS={resident_experts!r}: one of {', '.join(RESIDENT_EXPERTS)}")
        stream_experts = env.get("KESTREL_STREAM_EXPERTS") or "auto"
        if stream_experts not in STREAM_EXPERTS:
            raise ValueError(f"KESTREL_STREAM_EXPERTS={stream_experts!r}: one of {', '.join(STREAM_EXPERTS)}")
        options = cls(prof=env.get("KESTREL_PROF") == "1", trace_path=env.get("KESTREL_TRACE") or None,
                      verify=env.get("KESTREL_VERIFY") == "1", programmatic_launch=env.get("KESTREL_PDL", "1") != "0",
                      fused_rope=env.get("KESTREL_FUSED_ROPE", "1") != "0", step_graphs=step_graphs == "1",
                      host_nodes=host_nodes == "1", ring_graphs=ring_graphs == "1",
                      host_reads_images=host_reads_images == "1",
                      expert_images=expert_images,
                      link_experts=_link_experts(env.get("KESTREL_LINK_EXPERTS")),
                      minflop=_minflop(env.get("KESTREL_MINFLOP")), gemv_m1=m1, gemv_mn=mn, gemv_block=block,
                      block_mma_min_tokens=block_mma, moe_mma_tile=moe_mma_tile, moe_gemv=moe_gemv,
                      moe_mma_min_tokens=_tokens(env.get("KESTREL_MOE_MMA_MIN_TOKENS"), "KESTREL_MOE_MMA_MIN_TOKENS"),
                      cublas_min_tokens=_tokens(env.get("KESTREL_CUBLAS_MIN_TOKENS"), "KESTREL_CUBLAS_MIN_TOKENS"),
                      kernel_cache_dir=_path(env.get("KESTREL_KERNEL_CACHE")),
                      cache_dir=_path(env.get("KESTREL_CACHE_DIR")),
                      host_isa=host_isa, host_cc=env.get("CC") or None, host_kernels=host_kernels,
                      host_spin_us=_tokens(env.get("KESTREL_HOST_SPIN_US"), "KESTREL_HOST_SPIN_US", "microseconds"),
                      blas_threads=blas_threads,
                      offload=offload, offload_homes=env.get("KESTREL_OFFLOAD_HOMES") or None,
                      resident_experts=resident_experts, stream_experts=stream_experts,
                      host_reserve=_size(env.get("KESTREL_HOST_RESERVE"), "KESTREL_HOST_RESERVE"))
        return options.with_(**given)

    def with_(self, **changes) -> "Options":
        """A copy with `changes`; a VRAM budget is parsed here (bytes or a fraction), once."""
        if "vram_budget" in changes:
            changes["vram_budget"] = parse_vram_budget(changes["vram_budget"])
        return replace(self, **changes)


OFFLOAD_CHOICES = ("auto", "stream", "place")
RESIDENT_EXPERTS = ("frequency", "uniform", "none")    # scheduler/expert_residency.POLICIES, or none
STREAM_EXPERTS = ("auto", "on", "off")          # mode offload's experts' ring (budget.plan_offload_memory)
_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_vram_budget(value) -> int | float | None:
    """`2GiB`, `1500MB`, `123456` (bytes) → int bytes; `0.5` → a fraction (0, 1] of free VRAM; None stays None.

    Already-parsed values pass through, so every entry point may call it.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    if isinstance(value, float) and 0 < value <= 1:
        return value
    text = str(value).strip()
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"--vram-budget {value!r}: expected a size such as 2GiB, 1500MB or 4000000000 "
                         f"(bytes), or a fraction of free VRAM such as 0.5")
    number, unit = match.group(1), match.group(2).lower()
    if not unit and "." in number:
        fraction = float(number)
        if not 0 < fraction <= 1:
            raise ValueError(f"--vram-budget {value!r}: a fraction of free VRAM must be in (0, 1]")
        return fraction
    size = int(float(number) * _BYTE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"--vram-budget {value!r}: the budget must be positive")
    return size


def _size(text: str | None, name: str) -> int | None:
    """A size >= 0 from the environment (`8GiB`, `500MB`, `0`, bytes), or None when unset/empty."""
    text = (text or "").strip()
    if not text:
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"{name}={text!r}: expected a size such as 8GiB, 500MB or 0 (bytes)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


def _tokens(text: str | None, name: str, unit: str = "tokens") -> int | None:
    """A count >= 0 (of tokens, or `unit`) from the environment, or None when unset/empty."""
    text = (text or "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{name}={text!r}: expected a number of {unit} >= 0" + (" (0: off)" if unit == "tokens" else ""))
    return int(text)


def _link_experts(text: str | None) -> int | str:
    """KESTREL_LINK_EXPERTS: a count of choices (0: off), "auto" or "defer"."""
    if (text or "").strip().lower() in ("auto", "defer"):
        return text.strip().lower()
    try:
        return _tokens(text, "KESTREL_LINK_EXPERTS", "choices") or 0
    except ValueError:
        raise ValueError(f"KESTREL_LINK_EXPERTS={text!r}: expected a number of choices >= 0 (0: off), auto or "
                         "defer") from None


def _minflop(text: str | None) -> float | None:
    """KESTREL_MINFLOP as a number of FLOPs, or None when unset/empty."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"KESTREL_MINFLOP={text!r}: expected a number of FLOPs, e.g. 1e7") from None
    if value < 0:
        raise ValueError(f"KESTREL_MINFLOP={text!r}: must be >= 0")
    return value


def default_cache_root(environ=None) -> Path:
    """~/.cache/kestrel-stream, or $XDG_CACHE_HOME/kestrel-stream where that is set: the default home of the
    quantized-weight, kernel and profile caches."""
    env = os.environ if environ is None else environ
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kestrel-stream"


@dataclass(frozen=True)
class Environment:
    """The daemon's, clients' and result files' settings from the environment (the engine's are Options)."""
    socket: str | None = None           # KESTREL_SOCKET
    token: str | None = None            # KESTREL_TOKEN
    api_key: str | None = None          # KESTREL_API_KEY
    commit: str | None = None           # KESTREL_COMMIT
    runtime_dir: Path | None = None     # XDG_RUNTIME_DIR, when it is set

    @classmethod
    def from_env(cls, environ=None) -> "Environment":
        env = os.environ if environ is None else environ
        return cls(socket=env.get("KESTREL_SOCKET") or None, token=env.get("KESTREL_TOKEN") or None,
                   api_key=env.get("KESTREL_API_KEY") or None, commit=env.get("KESTREL_COMMIT") or None,
                   runtime_dir=_path(env.get("XDG_RUNTIME_DIR")))
