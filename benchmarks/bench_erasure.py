"""Throughput of the two candidate 10+2 erasure codecs (zfec, pyeclib) and the two candidate
shard checksums (xxhash, blake3) on the CPU, at the object sizes of the KV block store
(src/shoal/kvstore): 64 KiB, 256 KiB and 3 MiB.

Each codec runs behind the same framing as the store's codec: encode takes the object's bytes and
returns 12 shards; decode takes the shards with 0, 1 or 2 *data* shards lost (shard 0, then
shards 0 and 1: the losses that force a matrix solve) and returns the object. pyeclib runs with
its ISA-L and its built-in liberasurecode Reed-Solomon backends. Checksums run over one shard
(a tenth of the object), the unit the store checksums. The `shoal` row is the store's own codec
(shoal.kvstore.erasure.ErasureCodec) end to end. MB = 10^6 bytes; each figure is the best of 3 rounds.

    .venv/bin/python benchmarks/bench_erasure.py [--min-time 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import time
from collections.abc import Callable
from functools import partial

from shoal.bench import git_commit

K, M = 10, 2
SIZES = (64 << 10, 256 << 10, 3 << 20)
LOST = {0: (), 1: (0,), 2: (0, 1)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def best_time(fn: Callable[[], object], min_time: float) -> float:
    """Seconds per call: calls batched into rounds of at least min_time, best of 3 rounds."""
    n, t = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        if t >= min_time:
            break
        n *= 2 if t == 0 else max(2, min(10, int(min_time / t) + 1))
    best = t / n
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def zfec_codec():
    import zfec

    enc, dec = zfec.Encoder(K, K + M), zfec.Decoder(K, K + M)

    def encode(data: bytes) -> list[bytes]:
        size = -(-(len(data) + 8) // K)
        buf = bytearray(K * size)
        struct.pack_into("<Q", buf, 0, len(data))
        buf[8:8 + len(data)] = data
        view = memoryview(buf)
        blocks = [bytes(view[i * size:(i + 1) * size]) for i in range(K)]
        return blocks + enc.encode(blocks, tuple(range(K, K + M)))

    def decode(shards: list[bytes | None]) -> bytes:
        have = [(i, s) for i, s in enumerate(shards) if s is not None][:K]
        if have[-1][0] == K - 1:
            blocks = [s for _, s in have]
        else:
            blocks = dec.decode(tuple(s for _, s in have), tuple(i for i, _ in have))
        out = b"".join(blocks)
        (n,) = struct.unpack_from("<Q", out)
        return out[8:8 + n]

    return encode, decode


def pyeclib_codec(ec_type: str):
    from pyeclib.ec_iface import ECDriver

    driver = ECDriver(k=K, m=M, ec_type=ec_type)

    def decode(shards: list[bytes | None]) -> bytes:
        return driver.decode([s for s in shards if s is not None])

    return driver.encode, decode


def shoal_codec():
    from shoal.kvstore.erasure import ErasureCodec

    codec = ErasureCodec(K, M)  # as the store holds it (the module functions build one per call)
    return codec.encode, codec.decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-time", type=float, default=0.1, help="seconds per timing round")
    args = ap.parse_args()
    rng = os.urandom
    objects = {size: rng(size) for size in SIZES}
    codecs: dict[str, Callable[[], tuple]] = {
        "zfec": zfec_codec,
        "pyeclib/isa_l_rs_vand": lambda: pyeclib_codec("isa_l_rs_vand"),
        "pyeclib/liberasurecode_rs_vand": lambda: pyeclib_codec("liberasurecode_rs_vand"),
        "shoal": shoal_codec,
    }
    records: list[dict] = []
    print(f"# {cpu_name()}, {os.cpu_count()} logical cores, Python {platform.python_version()}")
    print("# 10+2 codecs, MB/s of object bytes (MB = 1e6 B); decode-N = N data shards lost")
    header = f"{'codec':32s} {'size':>8s} {'encode':>9s} {'decode-0':>9s} {'decode-1':>9s} " \
             f"{'decode-2':>9s}"
    print(header)
    for name, make in codecs.items():
        try:
            encode, decode = make()
        except Exception as exc:  # an uninstallable library is reported, not fatal
            print(f"{name:32s} unavailable: {type(exc).__name__}: {exc}")
            records.append({"kind": "codec", "lib": name, "error": str(exc)})
            continue
        for size, data in objects.items():
            shards = encode(data)
            row = {"encode": size / best_time(partial(encode, data), args.min_time) / 1e6}
            for lost, idx in LOST.items():
                have: list[bytes | None] = [None if i in idx else s for i, s in enumerate(shards)]
                if lost == 0:
                    have[K:] = [None] * M  # all data shards present: the store reads only those
                assert decode(have) == data, (name, size, lost)
                t = best_time(partial(decode, have), args.min_time)
                row[f"decode_{lost}"] = size / t / 1e6
            records.append({"kind": "codec", "lib": name, "size": size, "mb_s": row})
            print(f"{name:32s} {size >> 10:6d}Ki " + " ".join(f"{v:9.0f}" for v in row.values()))

    print("\n# shard checksums, MB/s over one shard (object size / 10)")
    checksums: dict[str, Callable[[], Callable[[bytes], object]]] = {}
    try:
        import xxhash

        checksums["xxhash.xxh3_64"] = lambda: xxhash.xxh3_64_intdigest
        checksums["xxhash.xxh64"] = lambda: xxhash.xxh64_intdigest
    except ImportError as exc:
        print(f"xxhash unavailable: {exc}")
    try:
        import blake3

        checksums["blake3"] = lambda: (lambda b: blake3.blake3(b).digest())
    except ImportError as exc:
        print(f"blake3 unavailable: {exc}")
    print(f"{'checksum':32s} " + " ".join(f"{s // K >> 10:>7d}Ki" for s in SIZES))
    for name, make in checksums.items():
        fn = make()
        speeds = []
        for size, data in objects.items():
            shard = data[:size // K]
            speeds.append(len(shard) / best_time(partial(fn, shard), args.min_time) / 1e6)
            records.append({"kind": "checksum", "lib": name, "size": len(shard),
                            "mb_s": speeds[-1]})
        print(f"{name:32s} " + " ".join(f"{v:9.0f}" for v in speeds))
    print(json.dumps({"bench": "erasure", "commit": git_commit(), "machine": "cpu",
                      "cpu": cpu_name(), "results": records}))


if __name__ == "__main__":
    main()
