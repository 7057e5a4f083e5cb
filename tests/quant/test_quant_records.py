"""KV-cache byte records: sizes, byte layout against the numpy oracle, and round trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.quant import (
    compressed_record_bytes,
    index_k_record_bytes,
    pack_compressed_record,
    pack_index_k_record,
    pack_swa_record,
    qdq_fp8_act,
    qdq_mxfp4,
    qdq_nvfp4,
    swa_record_bytes,
    unpack_compressed_record,
    unpack_index_k_record,
    unpack_swa_record,
)

F32 = np.float32
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.float().cpu().numpy().view(np.uint32)


def test_record_sizes():
    assert swa_record_bytes(512) == 528
    assert compressed_record_bytes(512) == 288
    assert index_k_record_bytes(128) == 68
    assert swa_record_bytes(64) == 66 and compressed_record_bytes(32) == 18
    assert index_k_record_bytes(32) == 17
    for fn, bad in ((swa_record_bytes, 48), (compressed_record_bytes, 24),
                    (index_k_record_bytes, 0), (swa_record_bytes, -32)):
        with pytest.raises(ValueError, match="dim"):
            fn(bad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swa_record(ref, seed, device, dtype):
    rng = np.random.default_rng(seed)
    kv = torch.from_numpy(ref.random_values(rng, (7, 512), block=32)).to(dtype).to(device)
    rec = pack_swa_record(kv)
    assert rec.dtype == torch.uint8 and rec.shape == (7, 528) and rec.device == kv.device
    codes, scales, deq = ref.fp8_act(kv.float().cpu().numpy(), 32)
    np.testing.assert_array_equal(rec[:, :512].cpu().numpy(), codes)  # e4m3 bytes, dims in order
    np.testing.assert_array_equal(rec[:, 512:].cpu().numpy(), scales)  # scale k: dims 32k..32k+31
    out = unpack_swa_record(rec, 512)
    assert out.dtype == torch.float32 and out.shape == (7, 512)
    np.testing.assert_array_equal(_bits(out), deq.view(np.uint32))
    np.testing.assert_array_equal(_bits(out), _bits(qdq_fp8_act(kv)))
    # re-packing the dequantised values gives back the same values
    np.testing.assert_array_equal(_bits(unpack_swa_record(pack_swa_record(out), 512)), _bits(out))


@pytest.mark.parametrize("device", DEVICES)
def test_compressed_record(ref, seed, device):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(ref.random_values(rng, (5, 512), block=16)).bfloat16().to(device)
    rec = pack_compressed_record(x)
    assert rec.dtype == torch.uint8 and rec.shape == (5, 288)
    packed, sbytes, deq = ref.nvfp4(x.float().cpu().numpy(), 16)
    np.testing.assert_array_equal(rec[:, :256].cpu().numpy(), packed)  # low nibble = even dim
    np.testing.assert_array_equal(rec[:, 256:].cpu().numpy(), sbytes)  # e4m3 scale bytes
    out = unpack_compressed_record(rec, 512)
    assert out.dtype == torch.float32 and out.shape == (5, 512)
    np.testing.assert_array_equal(_bits(out), deq.view(np.uint32))
    np.testing.assert_array_equal(_bits(out), _bits(qdq_nvfp4(x)))


@pytest.mark.parametrize("device", DEVICES)
def test_index_k_record(ref, seed, device):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(ref.random_values(rng, (9, 128), block=32)).bfloat16().to(device)
    rec = pack_index_k_record(x)
    assert rec.dtype == torch.uint8 and rec.shape == (9, 68)
    packed, sbytes, deq = ref.mxfp4(x.float().cpu().numpy(), 32)
    np.testing.assert_array_equal(rec[:, :64].cpu().numpy(), packed)
    np.testing.assert_array_equal(rec[:, 64:].cpu().numpy(), sbytes)
    out = unpack_index_k_record(rec, 128)
    np.testing.assert_array_equal(_bits(out), deq.view(np.uint32))
    np.testing.assert_array_equal(_bits(out), _bits(qdq_mxfp4(x)))
    np.testing.assert_array_equal(_bits(unpack_index_k_record(pack_index_k_record(out), 128)),
                                  _bits(out))


def test_record_nibble_order_golden():
    # dims 0, 1 = 1.0, 6.0 with amax 6 -> compressed scale 1.0, codes 2 and 7 -> byte 0x72
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 1.0, 6.0
    rec = pack_compressed_record(x)
    assert rec.shape == (1, 9) and rec[0, 0].item() == 0x72 and rec[0, 8].item() == 0x38
    assert unpack_compressed_record(rec, 16)[0, :2].tolist() == [1.0, 6.0]


def test_records_empty_batched_and_errors():
    assert pack_swa_record(torch.zeros(0, 512)).shape == (0, 528)
    assert unpack_swa_record(torch.zeros(0, 528, dtype=torch.uint8), 512).shape == (0, 512)
    assert pack_compressed_record(torch.zeros(2, 3, 64)).shape == (2, 3, 36)
    assert unpack_index_k_record(torch.zeros(2, 3, 68, dtype=torch.uint8), 128).shape == (2, 3, 128)
    with pytest.raises(ValueError, match="rec.shape"):
        unpack_swa_record(torch.zeros(2, 527, dtype=torch.uint8), 512)
    with pytest.raises(ValueError, match="rec.dtype"):
        unpack_compressed_record(torch.zeros(2, 288), 512)
    with pytest.raises(ValueError, match="dim"):
        pack_index_k_record(torch.zeros(2, 48))
