"""Engram tables in pinned host memory (GPU only): a host-mapped tensor is read in place by
kernels; `engram_placement="host"` gives device placement's tokens and logprobs bitwise and
keeps the tables out of GPU memory."""

from __future__ import annotations

import gc

import pytest
import torch

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA sm_90")]


def test_a_host_mapped_tensor_is_read_in_place() -> None:
    from shoal.runner.host_mapped import host_mapped

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.uint8, torch.float8_e4m3fn, torch.bfloat16):
        src = torch.randint(0, 255, (1000, 48), dtype=torch.uint8, generator=g).view(dtype)
        view = host_mapped(src, torch.device("cuda"))
        assert view.is_cuda and view.dtype == dtype and view.shape == src.shape
        rows = torch.tensor([0, 999, 7, 7, 512], device="cuda")
        assert torch.equal(view[rows].view(torch.uint8).cpu(), src[rows.cpu()].view(torch.uint8))
    before = torch.cuda.memory_allocated()
    host_mapped(torch.zeros(64 << 20, dtype=torch.uint8), torch.device("cuda"))
    assert torch.cuda.memory_allocated() == before  # no device allocation


def _run(placement: str):
    from shoal import LLM, SamplingParams

    llm = LLM("tiny", device="cuda", load_format="dummy", kv_cache_memory_gb=1.0,
              max_num_seqs=4, max_model_len=256, engram_placement=placement)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    outs = llm.generate([[5, 6, 7] * 20, list(range(1, 90)), [42]], params, use_tqdm=False)
    table = llm.engine.runner.model.params["layers.1.engram.embed.weight"]
    got = [(o.outputs[0].token_ids, [sorted((t, v.logprob) for t, v in e.items())
                                      for e in o.outputs[0].logprobs]) for o in outs]
    return got, table


def test_host_placement_equals_device_placement() -> None:
    want, table = _run("device")
    device_ptr = table.data_ptr()
    del table
    gc.collect()
    got, table = _run("host")
    assert got == want
    assert table.is_cuda and table.data_ptr() != device_ptr
    ptr = table.data_ptr()  # host memory: inside none of the caching allocator's segments
    segments = [(s["address"], s["address"] + s["total_size"])
                for s in torch.cuda.memory_snapshot()]
    assert not any(lo <= ptr < hi for lo, hi in segments)


def test_a_node_shared_mapping_is_registered_and_read_in_place() -> None:
    """What the ranks of a node do with the host tables (here one process): a /dev/shm file
    mapping, page-locked in place, read by the GPU through a host-mapped view."""
    from shoal.runner.host_mapped import host_mapped, node_shared

    g = torch.Generator().manual_seed(4)
    src = torch.randint(0, 255, (4096, 64), dtype=torch.uint8, generator=g)
    ((name, mapped),) = node_shared(iter([("t", src)]), {"t": ((4096, 64), torch.uint8)},
                                    "gpu-test", True, lambda: None)
    view = host_mapped(mapped, torch.device("cuda"), in_place=True)
    assert view.data_ptr() == mapped.data_ptr()  # unified addressing: the same pointer
    rows = torch.tensor([0, 4095, 17], device="cuda")
    assert torch.equal(view[rows].cpu(), src[rows.cpu()])


def test_tables_made_on_the_gpu_equal_the_cpus() -> None:
    """Dummy host tables are computed on the GPU and copied to the CPU (far faster than the
    CPU's own generation): the same bits."""
    from shoal.checkpoint.writer import generate_weights
    from shoal.config import resolve_model_config
    from shoal.model.weights import checkpoint_inventory, is_engram_table

    cfg = resolve_model_config("tiny")
    names = [n for n in checkpoint_inventory(cfg) if is_engram_table(n)]
    on_cpu = dict(generate_weights(cfg, seed=3, names=names))
    via_gpu = dict(generate_weights(cfg, seed=3, names=names, work_device="cuda"))
    assert names and on_cpu.keys() == via_gpu.keys()
    for name, t in on_cpu.items():
        assert via_gpu[name].device.type == "cpu"
        assert torch.equal(via_gpu[name].view(torch.uint8), t.view(torch.uint8)), name
