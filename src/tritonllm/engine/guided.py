"""Constrained decoding (structured output): guides -> grammars -> per-request matchers -> token masks.

Guide types are NVIDIA's (`guided_decoding_guide_type`): `json` (any JSON object or array, the top
level that TensorRT-LLM's `json` allows: xgrammar's builtin JSON grammar), `json_schema`, `regex` and
`ebnf_grammar` (GBNF, as llama.cpp and xgrammar write it: `root ::= ...`). llguidance compiles them and
computes, each step, the set of tokens that keep the output inside the grammar.

- `grammar_for` checks a guide without a tokenizer (SamplingParams validation), cached by content.
- `GuideCompiler` binds grammars to the model's tokenizer, cached by content; every request gets a
  copy of the cached matcher (`GuideMatcher`), which learns each accepted output token.
- `TokenMasks` fills the bitmasks of a step's constrained rows in one call and masks their logits;
  rows without a guide are not touched.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Iterable

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark

from tritonllm.engine.errors import InvalidRequestError

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
TYPE_FIELD = "guided_decoding_guide_type"
GUIDE_FIELD = "guided_decoding_guide"
# One fixed JSON layout, `{"a": 1, "b": [2, 3]}`: free whitespace lets a small model loop on newlines
# until max_tokens. A schema's own "x-guidance" options override it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Guide type `json`: an object or an array at the top level, as the root of xgrammar's builtin JSON
# grammar (mlc-ai/xgrammar cpp/grammar.cc, kJSONGrammarString, the same from v0.1.19 to v0.2.x), which
# TensorRT-LLM compiles for it (cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp).
ANY_JSON = {"type": ["object", "array"]}


def _invalid(field: str, message: str) -> InvalidRequestError:
    """llguidance's messages draw carets over several lines: one line reads better in a response."""
    return InvalidRequestError(field, " ".join(message.split()))


@functools.lru_cache(maxsize=256)
def grammar_for(guide_type: str | None, guide: str | None) -> str:
    """The llguidance grammar of a guide, checked; InvalidRequestError names the tensor at fault."""
    if guide_type not in GUIDE_TYPES:
        if guide_type is None:
            raise _invalid(TYPE_FIELD, f"is required with {GUIDE_FIELD} (one of {', '.join(GUIDE_TYPES)})")
        raise _invalid(TYPE_FIELD, f"must be one of {', '.join(GUIDE_TYPES)}, got {guide_type!r}")
    if guide_type == "json":
        if guide:
            raise _invalid(GUIDE_FIELD, "must be empty for guide type 'json'; send a schema as 'json_schema'")
        grammar = LLMatcher.grammar_from_json_schema(ANY_JSON, defaults=JSON_LAYOUT)
    elif not guide:
        raise _invalid(GUIDE_FIELD, f"is required for guide type {guide_type!r}")
    elif guide_type == "json_schema":
        try:
            schema = json.loads(guide)
        except ValueError as exc:
            raise _invalid(GUIDE_FIELD, f"is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise _invalid(GUIDE_FIELD, f"a JSON schema must be an object, got {type(schema).__name__}")
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    elif guide_type == "regex":
        grammar = LLMatcher.grammar_from_regex(guide)
    else:
        try:
            lark = any_to_lark(guide)
        except Exception as exc:  # the converter raises bare Exceptions for grammar errors
            raise _invalid(GUIDE_FIELD, f"invalid EBNF grammar: {exc}") from None
        grammar = LLMatcher.grammar_from_lark(lark)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise _invalid(GUIDE_FIELD, f"invalid {guide_type}: {messages[0]}")
    return grammar


class GuideMatcher:
    """One request's position in its grammar; it learns each output token the engine accepts.

    Only output tokens are fed, once each, when they are sampled: a preempted request keeps its
    matcher as is while its tokens are recomputed, since recomputation samples nothing new.
    """

    def __init__(self, matcher: LLMatcher):
        self._matcher = matcher

    @property
    def llmatcher(self) -> LLMatcher:
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and `error` set) if the grammar rejects it."""
        return self._matcher.consume_token(token)

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match (an end token may follow)."""
        return self._matcher.is_accepting()

    @property
    def is_complete(self) -> bool:
        """The grammar allows no further token: the request is done."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GuideCompiler:
    """Grammars bound to one model's tokenizer, cached by (guide type, guide).

    The tokenizer is converted on the first guided request (~1 s for a 49k vocabulary); later
    requests with a guide seen before copy the cached matcher (microseconds). Thread-safe: requests
    are validated on the submitting threads.
    """

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_ids: Iterable[int], cache_size: int = 128):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None
        self._cache: collections.OrderedDict[tuple[str | None, str | None], LLMatcher] = (
            collections.OrderedDict()
        )

    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from llguidance.hf import from_tokenizer

                from tritonllm.tokenization import load_tokenizer

                self._tokenizer = from_tokenizer(
                    load_tokenizer(self.tokenizer_dir),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos_ids or None,
                )
            return self._tokenizer

    def compile(self, guide_type: str | None, guide: str | None) -> LLMatcher:
        """The cached start-state matcher of a guide; raises InvalidRequestError for a bad guide."""
        key = (guide_type, guide)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        grammar = grammar_for(guide_type, guide)
        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise _invalid(GUIDE_FIELD, f"invalid {guide_type}: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, guide_type: str | None, guide: str | None) -> GuideMatcher:
        """A fresh matcher for one request."""
        return GuideMatcher(self.compile(guide_type, guide).deep_copy())


class TokenMasks:
    """Masks the logits of a step's constrained rows to the tokens their grammars allow.

    Bitmasks (one bit per token, llguidance's little-endian layout) are filled for all constrained
    rows in one call, in parallel threads when there are several; each byte then picks a row of a
    [256, 8] table of 0 / -inf, and that bias is added to the rows in place (a float add is ~15x
    faster than `masked_fill_` with a bool mask here). Unconstrained rows are never touched.
    """

    def __init__(self, num_threads: int | None = None):
        self._executor: LLExecutor | None = None
        self._num_threads = num_threads
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
        banned = ((byte >> torch.arange(8, dtype=torch.int32)) & 1) == 0
        self._bias_table = torch.zeros(256, 8).masked_fill_(banned, float("-inf"))

    def _fill(self, matchers: list[GuideMatcher], vocab_size: int) -> torch.Tensor:
        bits = torch.zeros(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)
        row_bytes = bits.shape[1] * bits.element_size()
        if len(matchers) == 1:
            matchers[0].llmatcher.unsafe_compute_mask_ptr(bits.data_ptr(), row_bytes)
        else:
            if self._executor is None:
                self._executor = LLExecutor(self._num_threads or torch.get_num_threads())
            pairs = [(m.llmatcher, i) for i, m in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(pairs, bits.data_ptr(), row_bytes, len(matchers))
        return bits

    def apply(
        self,
        logits: torch.Tensor,
        rows: list[int],
        matchers: list[GuideMatcher],
        end_ids: list[Iterable[int]],
    ) -> None:
        """In place: `logits[rows[i]]` keeps only what `matchers[i]` allows, plus `end_ids[i]` once
        the grammar is satisfied (the request's own end tokens, which may differ from the model's)."""
        vocab_size = logits.shape[-1]
        bits = self._fill(matchers, vocab_size)
        bias = self._bias_table.index_select(0, bits.view(torch.uint8).view(-1).long())
        bias = bias.view(len(rows), -1)[:, :vocab_size]
        for i, (matcher, ends) in enumerate(zip(matchers, end_ids, strict=True)):
            if ends and matcher.is_accepting:
                bias[i, list(ends)] = 0.0
        bias = bias.to(logits.device, logits.dtype)
        if len(rows) == logits.shape[0]:  # rows are in order: every row of the step is constrained
            logits.add_(bias)
        else:
            for i, row in enumerate(rows):
                logits[row].add_(bias[i])
