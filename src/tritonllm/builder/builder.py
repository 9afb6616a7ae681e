"""`build(options)`: validate, convert or compile into a staging folder, then swap it into place."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tritonllm.builder import torch_engine
from tritonllm.builder.checkpoint import TOKENIZER_FILES, checkpoint_sha256, validate_checkpoint
from tritonllm.builder.options import BuildError, BuildOptions, Limits
from tritonllm.engine import trtllm_executor
from tritonllm.engine_format import BUILD_KEY, FORMAT_VERSION, read_build_info

COPIED_FILES = (*TOKENIZER_FILES, "generation_config.json")


def log(message: str) -> None:
    print(f"build: {message}", file=sys.stderr, flush=True)


def check_output(out: Path, force: bool) -> None:
    """Refuse a non-empty folder unless `force` (which replaces it only once the build has worked)."""
    if out.exists() and not out.is_dir():
        raise BuildError(f"--output {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        info = read_build_info(out)
        what = f"a {info['backend']} engine ({info['quantization']})" if info else "other files"
        raise BuildError(f"--output {out} already holds {what}: pass --force to replace it")


def versions(backend: str) -> dict[str, str]:
    found = {}
    for name in ("tritonllm", "torch", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    if backend == "tensorrt_llm":
        found["tensorrt_llm"] = trtllm_executor.tensorrt_llm_version() or "unknown"
    return found


def build_record(options: BuildOptions, architecture: str, dtype: str, limits: Limits, sha256: str) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "backend": options.backend,
        "architecture": architecture,
        "dtype": dtype,
        "quantization": options.quantization,
        "kv_cache_dtype": options.kv_cache_dtype,
        "limits": limits.as_dict(),
        "tp_size": options.tp_size,
        "source": {"path": str(Path(options.model).resolve()), "sha256": sha256},
        "versions": versions(options.backend),
        "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_config(src: Path, dest: Path, record: dict[str, Any]) -> None:
    """Add the build record to the engine's config.json (the HF config for the torch backend)."""
    config_path = dest / "config.json"
    base = config_path if config_path.is_file() else src / "config.json"
    config = json.loads(base.read_text())
    config[BUILD_KEY] = record
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def swap_into_place(staging: Path, out: Path) -> None:
    """Replace `out` with `staging`; the old content is removed only after the rename."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{int(time.time() * 1000)}")
        out.rename(old)
    staging.rename(out)
    if old is not None:
        shutil.rmtree(old)


def build(options: BuildOptions) -> Path:
    """Build the engine directory `options.output`; returns it."""
    started = time.monotonic()
    src, out = Path(options.model).resolve(), Path(options.output).resolve()
    check_output(out, options.force)
    if options.model_repository:
        check_repository(Path(options.model_repository))
    log(f"checking {src}")
    args = validate_checkpoint(src)
    limits = Limits.resolve(options, args.max_position_embeddings)
    dtype = torch_engine.checkpoint_dtype(src) if options.dtype == "auto" else options.dtype
    sha256 = checkpoint_sha256(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        log(f"{options.backend} engine, {options.quantization}, {dtype}, limits {limits.as_dict()}")
        if options.backend == "torch":
            torch_engine.convert(src, staging, dtype, options.quantization)
        else:
            from tritonllm.builder import trtllm_build

            trtllm_build.build(options, src, staging, dtype, limits)
        for name in COPIED_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, staging / name)
        record = build_record(options, args.architecture, dtype, limits, sha256)
        record["build_seconds"] = round(time.monotonic() - started, 2)
        write_config(src, staging, record)
        check_output(out, options.force)  # nothing appeared there meanwhile
        swap_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"wrote {out} in {time.monotonic() - started:.1f}s")
    if options.model_repository:
        write_model_repository(out, Path(options.model_repository), limits)
    return out


def check_repository(repository: Path) -> None:
    from tritonllm.triton.repository import MARKER

    if repository.is_dir() and any(repository.iterdir()) and not (repository / MARKER).exists():
        raise BuildError(f"--model-repository {repository} is not empty and was not written by tritonllm")


def write_model_repository(engine_dir: Path, repository: Path, limits: Limits) -> Path:
    """A ready-to-serve Triton model repository for the engine (the launcher's templates)."""
    from tritonllm.triton.options import LaunchOptions
    from tritonllm.triton.repository import render_repository

    options = LaunchOptions(
        model=str(engine_dir), repository=str(repository), max_batch_size=limits.max_batch_size
    )
    render_repository(repository, options)
    log(f"wrote the model repository {repository} (tritonserver --model-repository={repository})")
    return repository
