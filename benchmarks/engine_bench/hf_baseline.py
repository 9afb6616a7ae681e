"""The baseline: HF transformers `generate()` on static batches, as a user would write it."""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .machine import log
from .workload import PromptSource, Request, ThroughputResult


class FirstTokenTimer:
    """A generate() streamer: the first put() is the prompt, the second the first generated tokens."""

    def __init__(self, progress: tqdm):
        self.calls = 0
        self.first_token_time: float | None = None
        self.progress = progress

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()
        if self.calls >= 2:
            self.progress.update(value.numel())

    def end(self) -> None:
        pass


def hf_generate_batch(model, batch: list[Request], pad_id: int, streamer=None) -> list[list[int]]:
    """Greedy, left-padded, running until the batch's longest request ends (EOS never stops it)."""
    width = max(len(r.prompt) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        input_ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
        mask[row, width - len(r.prompt) :] = 1
    steps = max(r.max_tokens for r in batch)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad_id,
        streamer=streamer,
    )
    return [out[row, width : width + r.max_tokens].tolist() for row, r in enumerate(batch)]


def run_hf(model, requests: list[Request], batch_size: int, pad_id: int) -> tuple[ThroughputResult, dict]:
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    computed = sum(len(b) * max(r.max_tokens for r in b) for b in batches)
    outputs: dict[str, list[int]] = {}
    ttft: list[float] = []
    progress = tqdm(total=computed, desc="HF static batches", unit="tok", mininterval=5, file=sys.stdout)
    t0 = time.perf_counter()
    for batch in batches:
        timer = FirstTokenTimer(progress)
        tokens = hf_generate_batch(model, batch, pad_id, timer)
        ttft.extend([timer.first_token_time - t0] * len(batch))
        outputs.update({r.request_id: t for r, t in zip(batch, tokens, strict=True)})
    wall = time.perf_counter() - t0
    progress.close()
    useful = sum(r.max_tokens for r in requests)
    result = ThroughputResult.measured(
        "hf_static_batching",
        requests,
        computed,
        wall,
        ttft,
        extra={"batch_size": batch_size, "padded_waste_fraction": 1 - useful / computed},
    )
    return result, outputs


def logits_perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    return math.exp(F.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item())


def run_baseline(
    model_path: Path,
    tokenizer,
    source: PromptSource,
    requests: list[Request],
    batch_size: int,
    ppl_ids: list[int],
    phase_done: Callable[[str], None],
) -> tuple[ThroughputResult, dict, float]:
    """The HF throughput run (after a warm-up batch) and HF's perplexity on the bundled text."""
    from transformers import AutoModelForCausalLM

    log("HF baseline: loading the model in float32")
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_generate_batch(hf_model, [Request("warmup", source.take(32), 4)], pad_id)
    hf_result, hf_outputs = run_hf(hf_model, requests, batch_size, pad_id)
    phase_done("hf")
    log(
        f"HF: {hf_result.output_tokens_per_s:.1f} tok/s, wall {hf_result.wall_s:.1f} s, TTFT p50 "
        f"{hf_result.ttft_p50_s:.2f} s p95 {hf_result.ttft_p95_s:.2f} s"
    )
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ppl_ids])).logits[0]
    hf_ppl = logits_perplexity(logits, ppl_ids)
    del hf_model, logits
    gc.collect()
    return hf_result, hf_outputs, hf_ppl
