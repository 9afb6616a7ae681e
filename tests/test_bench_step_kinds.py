"""bench_step_kinds.py on the tiny model: every prompt token and every decode lands in exactly one kind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import bench_step_kinds  # noqa: E402


def test_steps_by_kind_account_for_every_token(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "kinds.json"
    argv = ["bench_step_kinds.py", "--model", str(tiny_llama_dir), "--workload", "c8", "--rounds", "1"]
    argv += ["--dtype", "float32", "--quantization", "none", "--threads", "1", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    assert bench_step_kinds.main() == 0
    (result,) = json.loads(out.read_text())["rounds"]
    kinds = result["kinds"]
    # c8: 8 requests of 128 prompt tokens and 128 output tokens; the first token comes with the prefill.
    assert sum(k["prefill_tokens"] for k in kinds.values()) == 8 * 128
    assert sum(k["decode_tokens"] for k in kinds.values()) == 8 * 127
    assert kinds["decode 16"]["steps"] == 127  # the 8 decoding together from the step after the prefill
    assert result["tok_s"] > 0
