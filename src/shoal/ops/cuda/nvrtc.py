"""Run-time compilation of the CUDA C++ kernels (`ops/cuda/*.cu`) by NVRTC through cuda-python
(`cuda-bindings` and `nvidia-cuda-nvrtc` from PyPI: a user needs no CUDA toolkit), with the
cubins cached on disk.

Every compile gets the headers beside this module (`*.cuh`, included by name). A cubin is keyed
by its source, the headers, the compile options and NVRTC's version, and kept in
`<cache>/cuda/<key>.cubin` (`<cache>`: $SHOAL_CACHE_DIR, else $XDG_CACHE_HOME/shoal, else
~/.cache/shoal), written to a temporary name and renamed, so concurrent processes never read a
partial file and a second start compiles nothing. Compiling needs no GPU (CPU tests build the
kernels for sm_90a).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).parent


class NvrtcError(RuntimeError):
    """NVRTC is missing, or a kernel failed to compile (the message holds NVRTC's log)."""


def available() -> bool:
    """Whether NVRTC can be loaded (cuda-bindings and an NVRTC library installed)."""
    try:
        version()
    except NvrtcError:
        return False
    return True


def version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise NvrtcError("the CUDA kernels need cuda-python: pip install 'shoal[cuda]' "
                         "(cuda-bindings and nvidia-cuda-nvrtc)") from exc
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # noqa: BLE001 - the library itself failed to load
        raise NvrtcError(f"NVRTC could not be loaded: {exc}") from exc
    _check(err, "nvrtcVersion")
    return major, minor


def cache_dir() -> Path:
    root = os.environ.get("SHOAL_CACHE_DIR")
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = str(Path(xdg) / "shoal") if xdg else str(Path.home() / ".cache" / "shoal")
    return Path(root) / "cuda"


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    cached: bool  # read from the disk cache (nothing compiled)


def compile_cubin(source: str, *, name: str, arch: str = "sm_90a",
                  options: tuple[str, ...] = ()) -> Compiled:
    """The cubin of `source` (file name `name` in NVRTC's messages) for `arch`, from the disk
    cache when present. options: extra NVRTC options (e.g. -D defines)."""
    from cuda.bindings import nvrtc

    opts = (f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *options)
    headers = headers_here()
    key = hashlib.sha256("\0".join((source, *opts, *(f"{n}\0{t}" for n, t in headers),
                                     repr(version()))).encode()).hexdigest()[:32]
    path = cache_dir() / f"{Path(name).stem}-{key}.cubin"
    if path.exists():
        return Compiled(path.read_bytes(), cached=True)
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), len(headers),
                                         [t.encode() for _, t in headers],
                                         [n.encode() for n, _ in headers])
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise NvrtcError(f"{name} failed to compile for {arch}:\n{_log(prog)}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytes(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".part") as f:
        f.write(cubin)
    os.replace(f.name, path)
    return Compiled(cubin, cached=False)


def headers_here() -> list[tuple[str, str]]:
    """(name, text) of the headers beside this module, in name order."""
    return [(p.name, p.read_text()) for p in sorted(SOURCE_DIR.glob("*.cuh"))]


def compile_file(file: str, **kwargs) -> Compiled:
    """`compile_cubin` of a .cu file beside this module."""
    return compile_cubin((SOURCE_DIR / file).read_text(), name=file, **kwargs)


def _log(prog) -> str:
    from cuda.bindings import nvrtc

    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return "(no log)"
    log = bytes(size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    return log.rstrip(b"\0").decode(errors="replace")


def _check(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcError(f"{what} failed: {err!r}")
