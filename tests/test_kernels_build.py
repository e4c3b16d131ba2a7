"""CI (no GPU): every kernel family compiles with NVRTC for sm_80 and sm_90, warning-free,
and the device layer imports and reports "no GPU" cleanly when there is no driver."""
import importlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernels_ptx import build


ARCHS = ("sm_80", "sm_90")
COMPILE_TEST = "test_kernel_compiles_to_cubin_without_warnings"


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """(source, arch) -> (its cache directory, cubin, log) for every pair this run selected, compiled a few
    at a time: NVRTC lets go of the GIL for most of a compile, so on two cores the module takes ~2/3 of
    the time of one compile after another.  Each pair gets a directory of its own."""
    jobs = sorted({(item.callspec.params["source"], item.callspec.params["arch"])
                   for item in request.session.items if getattr(item, "originalname", None) == COMPILE_TEST})
    root = tmp_path_factory.mktemp("cubins")

    def compile_one(job):
        directory = root / f"{job[0]}-{job[1]}"
        return (directory, *build.compile_cubin(job[0], job[1], cache_dir=directory))
    with ThreadPoolExecutor(max_workers=min(max(os.cpu_count() or 1, 2), 4)) as pool:
        return dict(zip(jobs, pool.map(compile_one, jobs)))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", build.KERNEL_SOURCES)
def test_kernel_compiles_to_cubin_without_warnings(source, arch, compiled):
    directory, cubin, log = compiled[source, arch]
    assert cubin[:4] == b"\x7fELF", "NVRTC must produce CUBIN (ELF), not PTX"
    # No warning is explained away: any log text at all fails the build.
    assert log == "", f"{source} for {arch} compiled with messages:\n{log}"
    again, log_cached = build.compile_cubin(source, arch, cache_dir=directory)
    assert again == cubin and log_cached == ""
    assert len(list(directory.glob("*.cubin"))) == 1


def test_cache_key_changes_with_options(tmp_path):
    build.compile_cubin("elementwise.cu", "sm_90", cache_dir=tmp_path)
    build.compile_cubin("elementwise.cu", "sm_90", ("-DKESTREL_TEST_KEY=1",), cache_dir=tmp_path)
    assert len(list(tmp_path.glob("elementwise-sm_90-*.cubin"))) == 2


def test_compile_error_carries_the_log(tmp_path):
    with pytest.raises(build.KernelBuildError, match="undefined_symbol_xyz"):
        build.compile_cubin("elementwise.cu", "sm_90", ("-Dfloat=undefined_symbol_xyz",), cache_dir=tmp_path)


def test_kernel_cache_directory_comes_from_the_options(tmp_path):
    from kestrel_stream.options import Options
    assert Options.from_env({"KESTREL_KERNEL_CACHE": str(tmp_path)}).kernel_cache_dir == tmp_path
    assert Options.from_env({}).kernel_cache_dir is None


@pytest.mark.parametrize("module", ["kestrel_stream.cuda", "kestrel_stream.cuda.driver",
                                    "kestrel_stream.cuda.kernels", "kestrel_stream.run.compat",
                                    "kestrel_stream.run.verify"])
def test_device_layer_imports_without_a_driver(module):
    importlib.import_module(module)


def test_detect_is_clean(monkeypatch):
    from kestrel_stream.cuda import driver
    text = driver.detect()
    assert isinstance(text, str)
    assert driver.gpu_available() == (not text.startswith("no GPU"))


def test_missing_driver_library_means_no_gpu(monkeypatch):
    from kestrel_stream.cuda import driver

    class DynamicLibNotFoundError(RuntimeError):
        pass

    def missing(flags):
        raise DynamicLibNotFoundError('"cuda" is an NVIDIA driver library')

    monkeypatch.setattr(driver, "_detected", None)
    monkeypatch.setattr(driver.cu, "cuInit", missing)
    assert driver.detect().startswith("no GPU")
    assert driver.gpu_available() is False
    with pytest.raises(driver.CudaError, match="no GPU"):
        driver.Device(0)
    monkeypatch.setattr(driver, "_detected", None)   # let later tests probe the real driver again


def test_gpu_status_pairs_with_detect():
    from kestrel_stream.cuda import driver
    available, reason = driver.gpu_status()
    assert available == driver.gpu_available() and isinstance(reason, str) and reason


def test_gemv_variant_table_matches_the_kernel_source():
    """Every single-token layout the launcher can pick is defined in q8_gemv.cu with the same
    threads x rows x unroll, and every one defined there is in the table."""
    import re
    from kestrel_stream.cuda import gemv_variants
    source = (build.source_dir() / "q8_gemv.cu").read_text()
    defined = {m[3]: gemv_variants.Variant(int(m[1]), int(m[0]), int(m[2]))
               for m in re.findall(r"^DEFINE_GEMV_1\((\d+), (\d+), (\d+), (\w+)\)", source, flags=re.M)}
    assert defined == {k: v for k, v in gemv_variants.VARIANTS.items() if k}
    multi = {m[3]: gemv_variants.Variant(int(m[1]), int(m[0]), int(m[2]))
             for m in re.findall(r"^DEFINE_GEMV_MN\((\d+), (\d+), (\d+), (\w+)\)", source, flags=re.M)}
    assert multi == {k: v for k, v in gemv_variants.MULTI_VARIANTS.items() if k}
    for suffix in gemv_variants.VARIANTS:
        for silu in (False, True):
            name = gemv_variants.kernel_name(1, suffix, silu)
            assert gemv_variants.parse(name) == (1, gemv_variants.VARIANTS[suffix], silu)
    assert gemv_variants.parse("q8_gemv_m5_silu") == (5, gemv_variants.MULTI_TOKEN, True)
    assert gemv_variants.parse("q8_gemv_m5_o64r4u2") == (5, gemv_variants.MULTI_VARIANTS["o64r4u2"], False)


def test_hmma_layouts_match_the_kernel_source():
    """Every fp16 tensor-core layout of 2..16 tokens (q8_gemv_hmma.cu) is defined with the table's warps and
    loads in flight, for 8 and 16 tokens, plain and SiLU; the default picks one for every weight shape."""
    import re
    from kestrel_stream.cuda import gemv_variants
    source = (build.source_dir() / "q8_gemv_hmma.cu").read_text()
    layouts = re.findall(r"^DEFINE_HMMA_LAYOUT\((\d+), (\d+), (\d+), (true|false), (\w+)\)", source, flags=re.M)
    defined = {"h" + m[4]: gemv_variants.Variant(32 * int(m[1]), 16 * int(m[0]), int(m[2])) for m in layouts}
    assert defined == gemv_variants.HMMA_VARIANTS
    pipelined = {"h" + m[4]: m[3] == "true" for m in layouts}
    for suffix, (threads, rows, unroll) in defined.items():
        assert suffix == f"hk{threads // 32}u{unroll}" + (f"r{rows // 16}" if rows > 16 else "") + \
            ("p" if pipelined[suffix] else "")
        for tokens, silu in ((2, False), (8, True), (9, False), (16, True)):
            name = gemv_variants.hmma_kernel_name(tokens, suffix, silu)
            assert gemv_variants.parse_hmma(name) == (8 if tokens <= 8 else 16, defined[suffix], silu)
    from kestrel_stream.cuda import hmma_launch, kernels
    assert hmma_launch.HMMA_SIGNATURE == kernels.GEMV_SIGNATURE, "the GEMV's argument list"
    for rows in (16, 2048, 4096, 12288, 151936):
        assert gemv_variants.multi_variant(4, None, rows) == gemv_variants.hmma_variant(rows) in defined
        assert gemv_variants.multi_variant(2, None, rows) == gemv_variants.multi_variant(2) in gemv_variants.MULTI_VARIANTS


@pytest.mark.parametrize("fmt,source", [("Q4_K", "q4k_gemv_hmma.cu"), ("Q6_K", "q6k_gemv_hmma.cu")])
def test_kquant_hmma_layouts_match_the_kernel_source(fmt, source):
    """Every K-quant layout of q4k_ / q6k_gemv_hmma.cu is defined with the table's warps and rows, for 8 and 16
    tokens, plain and SiLU; the default picks one of them for every weight shape."""
    import re
    from kestrel_stream.cuda import gemv_variants
    text = (build.source_dir() / source).read_text()
    layouts = re.findall(r"^DEFINE_SUPERBLOCK_HMMA_LAYOUT\((\w+), (\w+), (\d+), (\d+), (true|false), (\w+)\)", text,
                         flags=re.M)
    defined = {"h" + m[5]: gemv_variants.Variant(32 * int(m[3]), 16 * int(m[2]), 1) for m in layouts}
    assert defined == gemv_variants.HMMA_BLOCK_VARIANTS[fmt]
    pipelined = {"h" + m[5]: m[4] == "true" for m in layouts}
    for suffix, (threads, rows, _) in defined.items():
        assert suffix == f"hk{threads // 32}" + (f"r{rows // 16}" if rows > 16 else "") + ("p" if pipelined[suffix] else "")
        for tokens, silu in ((2, False), (8, True), (9, False), (16, True)):
            name = gemv_variants.hmma_block_kernel_name(fmt, tokens, suffix, silu)
            assert name.startswith(layouts[0][1] + "_t")
            assert gemv_variants.parse_hmma_block(name) == (fmt, 8 if tokens <= 8 else 16, defined[suffix], silu)
    for rows in (16, 2048, 12288, 151936):
        for cols in (256, 1024, 2048, 8960):
            for tokens in (3, 8, 16):
                assert gemv_variants.hmma_q4k_variant(rows, cols, tokens, fmt) in defined


def test_dense_gemm_tiles_match_the_kernel_source():
    """Every tile cuda/dense_gemm.GEMM_TILES launches is defined in q8_gemm_f16.cu with the same shape,
    warps and stages, fits an H200 block's shared memory, and the rule picks one for any step."""
    import re
    from kestrel_stream.cuda.dense_gemm import (ALL_GEMM_TILES, GEMM_TILES, MEASURED_GEMM, WGMMA_TILES, GemmTile,
                                                choose_gemm_tile, wgmma_tile)
    source = (build.source_dir() / "q8_gemm_f16.cu").read_text()
    defined = {GemmTile(*(int(v) for v in m[:5]))
               for m in re.findall(r"^DEFINE_Q8_GEMM_F16\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", source, flags=re.M)}
    assert defined == set(GEMM_TILES)
    wgmma = (build.source_dir() / "q8_wgmma.cu").read_text()
    assert {wgmma_tile(int(m[1]), int(m[2]), int(m[3])) for m in
            re.findall(r"^DEFINE_Q8_WGMMA\((\d+), (\d+), (\d+), (\d+)\)", wgmma, flags=re.M)} == set(WGMMA_TILES)
    assert all(tile.shared_bytes <= 227 * 1024 for tile in ALL_GEMM_TILES)
    names = {tile.name for tile in ALL_GEMM_TILES}
    assert set(MEASURED_GEMM.values()) <= names
    assert choose_gemm_tile(512, 24576, 4096).blocks(512, 24576) >= 132       # enough blocks: a large tile
    assert choose_gemm_tile(128, 2048, 2048) == GEMM_TILES[-1]                   # too few for any: the smallest


def test_dense_expansions_match_the_kernel_source():
    """Every format cuBLAS's dense path serves (scheduler.dense.BLAS_FORMATS) has its expansion kernel in
    dense_gemm.cu, over the q4_formats.cuh struct whose UNIT dense_gemm.BLOCK_UNITS says."""
    import re
    from kestrel_stream.cuda.dense_gemm import BLOCK_UNITS
    from scheduler.dense import BLAS_FORMATS
    source = (build.source_dir() / "dense_gemm.cu").read_text()
    defined = {name: (a, b) for a, b, name in
               re.findall(r"^DEFINE_BLOCK_DEQUANT\((\w+), (\w+), (\w+)\)", source, flags=re.M)}
    assert "q8_dequant_f16" in source
    for fmt, tail in BLAS_FORMATS:
        if fmt == "Q8_0":
            continue
        name = fmt.lower() + (f"_{tail.lower()}" if tail else "") + "_dequant_f16"
        assert defined[name] == ("Fmt" + fmt, "Fmt" + (tail or fmt)), name
    formats = (build.source_dir() / "q4_formats.cuh").read_text()
    for fmt, unit in BLOCK_UNITS.items():
        assert re.search(rf"struct Fmt{fmt} {{\s+static constexpr int UNIT = {unit},", formats), fmt


def test_gemv_variant_choice_and_override():
    from kestrel_stream.cuda import gemv_variants
    from kestrel_stream.options import Options
    for rows, cols in ((4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (151936, 2048), (38, 96)):
        assert gemv_variants.m1_variant(rows, cols) in gemv_variants.VARIANTS
    forced = Options.from_env({"KESTREL_GEMV_M1_ROWS": "4"}).gemv_m1
    assert gemv_variants.m1_variant(38, 96, forced) == "r4"
    forced = Options.from_env({"KESTREL_GEMV_M1_ROWS": "4", "KESTREL_GEMV_M1": "w32r2u4"}).gemv_m1
    assert gemv_variants.m1_variant(38, 96, forced) == "w32r2u4"
    for tokens in range(2, 9):
        assert gemv_variants.multi_variant(tokens) in gemv_variants.MULTI_VARIANTS
    assert gemv_variants.multi_variant(4, Options.from_env({"KESTREL_GEMV_MN": ""}).gemv_mn) == ""
    assert gemv_variants.multi_variant(4, Options.from_env({"KESTREL_GEMV_MN": "hk4u4r2"}).gemv_mn, 4096) == "hk4u4r2"
    with pytest.raises(ValueError, match="KESTREL_GEMV_MN='o2'"):
        Options.from_env({"KESTREL_GEMV_MN": "o2"})
    with pytest.raises(ValueError, match="KESTREL_GEMV_M1='w7': not a GEMV variant"):
        Options.from_env({"KESTREL_GEMV_M1": "w7"})


def test_flash_attention_table_matches_the_kernel_source():
    """The head dims and rows per block the launcher assumes are the ones flash_attention.cu defines,
    and every block's static shared memory stays under the 48 KiB that needs no opt-in."""
    import re
    from kestrel_stream.cuda import flash_attention as fa
    source = (build.source_dir() / "flash_attention.cu").read_text()
    assert tuple(int(d) for d in re.findall(r"^DEFINE_FLASH_ATTENTION\((\d+)\)", source, flags=re.M)) == \
        fa.FLASH_HEAD_DIMS
    assert re.search(r"^#define FLASH_WARPS (\d+)", source, flags=re.M)[1] == str(fa.FLASH_THREADS // 32)
    assert fa.FLASH_ROWS == 16 * fa.FLASH_THREADS // 32
    for D in fa.FLASH_HEAD_DIMS:            # K and V tiles, two stages, BN = 4096 / D keys of D + 8 halves
        shared_bytes = 2 * 2 * (4096 // D) * (D + 8) * 2 + fa.FLASH_ROWS * (8 + 4)
        assert shared_bytes < 48 * 1024, (D, shared_bytes)
