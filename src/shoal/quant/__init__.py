"""Quantised number formats of DeepSeek-V4.1-Flash: reference (bit-exact) torch definitions.

Owns UE8M0 scales (:mod:`.ue8m0`), FP8 e4m3 block quantisation (:mod:`.fp8`), FP4 e2m1 codes with
MXFP4 / NVFP4-style block scales (:mod:`.fp4`) and the KV-cache byte records (:mod:`.records`).
Invariant: every function here is pure and is the definition the fast kernels are tested against.
"""

from shoal.quant.fp4 import (
    dequant_mxfp4,
    dequant_nvfp4,
    e2m1_decode,
    e2m1_encode,
    pack_fp4,
    qdq_mxfp4,
    qdq_nvfp4,
    quant_mxfp4,
    quant_nvfp4,
    unpack_fp4,
)
from shoal.quant.fp8 import (
    dequant_fp8_act,
    dequant_fp8_weight,
    e4m3_saturate,
    qdq_fp8_act,
    quant_fp8_act,
    quant_fp8_weight,
)
from shoal.quant.records import (
    compressed_record_bytes,
    index_k_record_bytes,
    pack_compressed_record,
    pack_index_k_record,
    pack_swa_record,
    swa_record_bytes,
    unpack_compressed_record,
    unpack_index_k_record,
    unpack_swa_record,
)
from shoal.quant.ue8m0 import pow2_scale_ceil, ue8m0_decode, ue8m0_encode

__all__ = [
    "compressed_record_bytes",
    "dequant_fp8_act",
    "dequant_fp8_weight",
    "dequant_mxfp4",
    "dequant_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e4m3_saturate",
    "index_k_record_bytes",
    "pack_compressed_record",
    "pack_fp4",
    "pack_index_k_record",
    "pack_swa_record",
    "pow2_scale_ceil",
    "qdq_fp8_act",
    "qdq_mxfp4",
    "qdq_nvfp4",
    "quant_fp8_act",
    "quant_fp8_weight",
    "quant_mxfp4",
    "quant_nvfp4",
    "swa_record_bytes",
    "ue8m0_decode",
    "ue8m0_encode",
    "unpack_compressed_record",
    "unpack_fp4",
    "unpack_index_k_record",
    "unpack_swa_record",
]
