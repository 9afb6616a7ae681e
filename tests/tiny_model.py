"""Tiny random HF checkpoints for fast tests.

The engine must match transformers token for token on real architectures, but tests should not need
real weights: these builders save a random LlamaForCausalLM / Qwen2ForCausalLM (fp32, GQA, seeded) with
a byte-level BPE tokenizer trained here on the text below, in the same layout as a Hub checkpoint.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

TRAINING_TEXT = """\
Triton Inference Server runs models behind HTTP and gRPC endpoints. A client sends a request with a
prompt, the server queues it, and a model instance answers with tokens, one response at a time when
the model is decoupled. Streaming matters for chat: people start reading before the answer is done.

A paged key-value cache splits the memory of every sequence into fixed blocks of 16 tokens. Blocks are
allocated on demand and returned to a free list when a request finishes, so many requests of very
different lengths can share one pool without fragmentation. Continuous batching adds new requests to
the running batch at every step instead of waiting for the slowest sequence to finish.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! How vexingly
quick daft zebras jump; sphinx of black quartz, judge my vow? 0123456789 + 42 = 4242 - 3.14159 * 2.

def greedy(logits):
    return int(logits.argmax(-1))

Rotary position embeddings rotate pairs of query and key features by an angle that grows with the
position. Grouped-query attention lets several query heads share one key and value head, which cuts
the size of the cache. RMS normalization rescales each hidden vector by the root of its mean square.

Il était une fois un petit serveur qui répondait très vite. Ärger über Öl und Übermut. ¿Qué tal? 🙂
"""

ArchName = Literal["llama", "qwen2"]
VOCAB_SIZE = 512
SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@functools.cache
def _trained_tokenizer_json() -> str:
    """Train once per process: BPE training is deterministic, so every model shares one vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.split("\n\n"), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocabulary has {tokenizer.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return tokenizer.to_str()


def build_tokenizer(add_bos: bool) -> Any:
    """A fast tokenizer; ``add_bos`` mirrors Llama (prepends ``<s>``) versus Qwen2 (adds nothing)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json())
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        bos = SPECIAL_TOKENS["bos"]
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
        )
        backend.post_processor = processors.Sequence([byte_level, template])
    else:
        backend.post_processor = byte_level
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    out_dir: Path,
    *,
    arch: ArchName = "llama",
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    """Save a seeded random model plus tokenizer in ``out_dir`` and return it.

    ``initializer_range`` is wider than the default 0.02 so logits are spread out and greedy argmax
    is not decided by float rounding; biases (Qwen2's q/k/v) are randomized because zero biases would
    hide a bias that the engine forgets to add.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = build_tokenizer(add_bos=arch == "llama")
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
