"""The project's engine format: the HF tensors in the build dtype, linears quantized ahead of time.

`<linear>.weight` is stored as int8 (int8_wo, int8) or float8_e4m3fn (fp8) with `<linear>.weight_scale`
(fp32: one per output channel, or [out, in/32] per block of 32 for int8), computed by the same functions
the engine uses when it quantizes at load, so an engine directory runs exactly like quantizing the HF
checkpoint at start, minus the work.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from tritonllm.engine_format import SCALE_SUFFIX
from tritonllm.model.loader import TORCH_DTYPES
from tritonllm.model.quant import QUANTIZERS, head_quantization

WEIGHTS_FILE = "model.safetensors"
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_dtype(path: Path) -> str:
    """The dtype of the checkpoint's embedding table (what `--dtype auto` keeps)."""
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if "model.embed_tokens.weight" in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                stored = f.get_slice("model.embed_tokens.weight").get_dtype()
                return SAFETENSORS_DTYPES.get(stored, "float32")
    return "float32"


def is_linear_weight(name: str) -> bool:
    return name == "lm_head.weight" or (name.startswith("model.layers.") and name.endswith("_proj.weight"))


def convert(src: Path, dest: Path, dtype: str, quantization: str) -> None:
    """Write `dest/model.safetensors` from the checkpoint in `src`."""
    torch_dtype = TORCH_DTYPES[dtype]
    quantize = QUANTIZERS.get(quantization)
    files = sorted(src.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        if quantize is not None and is_linear_weight(name):
            how = QUANTIZERS[head_quantization(quantization)] if name == "lm_head.weight" else quantize
            out[name], out[name + SCALE_SUFFIX] = how(tensor.to(torch_dtype))
        else:
            out[name] = tensor.to(torch_dtype).contiguous()

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = [n for n in f.keys() if not n.endswith("rotary_emb.inv_freq")]  # noqa: SIM118
            for name in tqdm(names, desc=f"convert {file.name} ({quantization})", unit="tensor"):
                put(name, f.get_tensor(name))
    if quantize is not None and "lm_head.weight" not in out:  # tied: the head is stored quantized too
        put("lm_head.weight", out["model.embed_tokens.weight"])
    with tqdm(total=1, desc=f"write {WEIGHTS_FILE}", unit="file") as bar:
        save_file(out, str(dest / WEIGHTS_FILE), metadata={"format": "pt"})
        bar.update(1)
