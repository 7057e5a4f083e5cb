"""The CUDA C++ kernels build with NVRTC for sm_90a on any machine (no GPU needed), the cubin
is cached on disk (a second build compiles nothing), and a compile error reports NVRTC's log."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from shoal.ops.cuda import nvrtc  # noqa: E402

if not nvrtc.available():
    pytest.skip("NVRTC library not installed", allow_module_level=True)

SOURCES = sorted(p.name for p in nvrtc.SOURCE_DIR.glob("*.cu"))


@pytest.mark.parametrize("source", SOURCES)
def test_kernels_build_for_sm90a_and_are_cached(monkeypatch, tmp_path, source: str) -> None:
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    first = nvrtc.compile_file(source)
    assert not first.cached and first.cubin[:4] == b"\x7fELF"
    again = nvrtc.compile_file(source)
    assert again.cached and again.cubin == first.cubin
    assert [p.suffix for p in (tmp_path / "cuda").iterdir()] == [".cubin"]  # no partial files


@pytest.mark.parametrize("options", ["MOE_DEPTH=1", "MOE_DEPTH=3", "MOE_DEPTH=4"])
def test_moe_decode_variants_build(monkeypatch, tmp_path, options: str) -> None:
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    cubin = nvrtc.compile_file("moe_decode.cu",
                               options=tuple(f"-D{o}" for o in options.split())).cubin
    assert cubin[:4] == b"\x7fELF"
    _assert_no_spills(cubin, tmp_path)


def test_compile_error_carries_the_log(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    with pytest.raises(nvrtc.NvrtcError, match="undefined_name"):
        nvrtc.compile_cubin('extern "C" __global__ void k() { undefined_name(); }', name="bad.cu")


def test_options_change_the_key(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    src = 'extern "C" __global__ void k(int* x) { x[0] = V; }'
    a = nvrtc.compile_cubin(src, name="k.cu", options=("-DV=1",))
    b = nvrtc.compile_cubin(src, name="k.cu", options=("-DV=2",))
    assert not a.cached and not b.cached and a.cubin != b.cubin


@pytest.mark.parametrize("source", SOURCES)
def test_kernels_do_not_spill(monkeypatch, tmp_path, source: str) -> None:
    """Every kernel of every source fits its registers (cuobjdump's STACK:0): a spill in a
    hot loop costs more than any tiling gains."""
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    _assert_no_spills(nvrtc.compile_file(source).cubin, tmp_path)


def _assert_no_spills(cubin: bytes, tmp_path) -> None:
    import re
    import subprocess

    from shoal.ops.triton import aot

    if not aot.has_tools():
        pytest.skip("Triton's bundled cuobjdump is missing")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run([f"{aot.TOOLS}/cuobjdump", "--dump-resource-usage", str(path)],
                           capture_output=True, text=True, check=True).stdout
    stacks = re.findall(r"STACK:(\d+)", usage)
    assert stacks and all(s == "0" for s in stacks), usage


@pytest.mark.parametrize("mode", [1, 2])
def test_sparse_attn_wgmma_builds(monkeypatch, tmp_path, mode: int) -> None:
    """The wgmma variants of the sparse attention build for sm_90a with their wgmmas (mode 1
    at 255 registers spills 8 bytes, stored and loaded once per index block after the score
    loop: accepted; mode 2 does not spill)."""
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    cubin = nvrtc.compile_file("sparse_attn.cu", options=(f"-DATTN_WGMMA={mode}",)).cubin
    assert cubin[:4] == b"\x7fELF"
    if mode == 2:
        _assert_no_spills(cubin, tmp_path)
