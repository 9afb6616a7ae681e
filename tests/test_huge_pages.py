"""The weights the CPU kernels stream and the KV cache live in huge-page buffers (`model/huge_pages.py`):
one buffer per model, in the order a decode step reads the weights, asked of the OS with MADV_HUGEPAGE;
the model's output does not change."""

from __future__ import annotations

import mmap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tritonllm.engine import EngineConfig, LLMEngine, SamplingParams
from tritonllm.model import huge_pages
from tritonllm.model.cpu_kernels import load_kernels
from tritonllm.model.huge_pages import (
    HUGE_PAGE,
    huge_page_bytes,
    huge_page_share,
    huge_page_zeros,
    smaps_fields,
)
from tritonllm.model.loader import load_model
from tritonllm.model.quant import runs_on_kernels


def mapping(address: int) -> dict[str, str]:
    fields = smaps_fields(address)
    if fields is None:
        raise AssertionError(f"no mapping holds {address:#x}")
    return fields


def resident_kb(buffer: torch.Tensor) -> int:
    return int(mapping(buffer.data_ptr())["Rss"].split()[0])


def test_buffers_are_zeroed_aligned_and_advised() -> None:
    buffer = huge_page_bytes(3 * HUGE_PAGE + 5)
    assert buffer.numel() == 3 * HUGE_PAGE + 5 and buffer.data_ptr() % HUGE_PAGE == 0
    assert not buffer.any()
    buffer[-1] = 7
    assert buffer[-1] == 7
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():  # Linux with THP built in
        assert "hg" in mapping(buffer.data_ptr())["VmFlags"].split()  # MADV_HUGEPAGE took
    cache = huge_page_zeros((2, 3, 40, 16, 8), torch.bfloat16)
    assert cache.shape == (2, 3, 40, 16, 8) and cache.dtype == torch.bfloat16 and cache.is_contiguous()


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_a_populated_buffer_is_resident_before_its_first_write() -> None:
    """The KV pool's pages are faulted in at start (MADV_POPULATE_WRITE), not inside the steps that first
    write them; without `populate` they come on first touch."""
    lazy = huge_page_bytes(8 * HUGE_PAGE)
    populated = huge_page_bytes(8 * HUGE_PAGE, populate=True)
    assert resident_kb(lazy) < 2 * HUGE_PAGE // 1024  # at most the page the alignment slack touched
    assert resident_kb(populated) >= 8 * HUGE_PAGE // 1024
    assert not populated.any()


@pytest.mark.skipif(load_kernels() is None, reason="needs the CPU kernels")
@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_streamed_weights_sit_back_to_back_in_step_order(tiny_llama_dir: Path, quantization: str) -> None:
    model = load_model(tiny_llama_dir, "bfloat16", "cpu", quantization)
    order = [m for layer in model.layers for m in layer.linears] + [model.lm_head]
    assert all(runs_on_kernels(m) for m in order)
    addresses = [m.weight.data_ptr() for m in order]
    assert addresses == sorted(addresses) and all(a % 64 == 0 for a in addresses)
    assert len({m.weight.untyped_storage().data_ptr() for m in order}) == 1  # one buffer
    last = order[-1].weight
    span = addresses[-1] + last.numel() * last.element_size() - addresses[0]
    assert span < sum(m.weight.numel() * m.weight.element_size() + 64 for m in order)  # nothing between


def test_a_kernel_without_huge_pages_gets_plain_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """madvise fails (EINVAL) where the kernel has no THP: the buffer is still there, on 4 KB pages."""

    class RefusingMap(mmap.mmap):
        def madvise(self, *args) -> None:
            raise OSError(22, "Invalid argument")

    fake = SimpleNamespace(
        mmap=RefusingMap,
        MAP_PRIVATE=mmap.MAP_PRIVATE,
        MAP_ANONYMOUS=mmap.MAP_ANONYMOUS,
        MADV_HUGEPAGE=getattr(mmap, "MADV_HUGEPAGE", 14),
    )
    monkeypatch.setattr(huge_pages, "mmap", fake)
    buffer = huge_page_bytes(2 * HUGE_PAGE, populate=True)
    buffer[0] = 1
    assert buffer.numel() == 2 * HUGE_PAGE and buffer.sum() == 1


def test_a_tied_bf16_head_keeps_the_embedding_once(tiny_llama_tied_dir: Path) -> None:
    """Moving a row-major head would hold the embedding twice: it stays where the embedding is. A packed one
    (avx512_bf16 CPUs) is the only copy, and lookups read the rows from its tiles."""
    model = load_model(tiny_llama_tied_dir, "bfloat16", "cpu", "none")
    ids = torch.tensor([0, 5, 17, model.args.vocab_size - 1])
    if model.lm_head.packed:
        buffer = model.layers[0].qkv_proj.weight.untyped_storage().data_ptr()  # the streamed weights' buffer
        assert model.embed is None and model.lm_head.weight.untyped_storage().data_ptr() == buffer
        reference = load_model(tiny_llama_tied_dir, "float32", "cpu", "none").embed
        assert torch.equal(model.embed_tokens(ids), reference[ids].bfloat16())
    else:
        assert model.lm_head.weight.untyped_storage().data_ptr() == model.embed.untyped_storage().data_ptr()


@pytest.mark.skipif(load_kernels() is None, reason="needs the CPU kernels")
def test_greedy_output_is_the_same_on_huge_pages(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the same engine with weights and cache in PyTorch's own allocations."""
    config = EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", quantization="int8", num_kv_blocks=64)
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def generate() -> list[int]:
        engine = LLMEngine(config)
        engine.add_request("r", list(range(3, 40)), params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        return tokens

    on_huge_pages = generate()
    import tritonllm.engine.model_runner as model_runner
    import tritonllm.model.loader as loader

    monkeypatch.setattr(loader, "move_weights_to_huge_pages", lambda modules: None)
    monkeypatch.setattr(
        model_runner, "huge_page_zeros", lambda shape, dtype, populate: torch.zeros(shape, dtype=dtype)
    )
    assert generate() == on_huge_pages and len(on_huge_pages) == 24


def test_huge_page_share_reads_the_mapping_that_holds_the_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsed from /proc/self/smaps: the fields of the mapping holding the address, not its neighbours'."""
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "1000-2000 rw-p 00000000 00:00 0\nRss:  4 kB\nAnonHugePages:  0 kB\n"
        "400000-c00000 rw-p 00000000 00:00 0\nRss:  8192 kB\nAnonHugePages:  6144 kB\nVmFlags: rd wr hg\n"
        "c00000-c01000 rw-p 00000000 00:00 0\nRss:  4 kB\nAnonHugePages:  0 kB\n"
    )
    monkeypatch.setattr(huge_pages, "Path", lambda _: smaps)
    inside = SimpleNamespace(data_ptr=lambda: 0x800000)
    assert huge_page_share(inside) == pytest.approx(0.75)
    assert smaps_fields(0x800000)["VmFlags"] == "rd wr hg"
    assert huge_page_share(SimpleNamespace(data_ptr=lambda: 0x1000)) == 0.0
    assert huge_page_share(SimpleNamespace(data_ptr=lambda: 0xF00000)) is None  # no mapping holds it
    monkeypatch.setattr(huge_pages, "Path", lambda _: tmp_path / "absent")
    assert huge_page_share(inside) is None  # not Linux


@pytest.mark.skipif(load_kernels() is None, reason="needs the CPU kernels")
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_the_engine_logs_how_much_of_its_streamed_weights_sits_on_huge_pages(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="tritonllm.engine.model_runner"):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), quantization="int8", num_kv_blocks=8))
        LLMEngine(
            EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8)
        )  # fp32: no kernel-streamed weights
    int8, fp32 = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine:")]
    assert "weights on 2 MB pages=" in int8 and int8.endswith("%")
    assert "2 MB pages" not in fp32
