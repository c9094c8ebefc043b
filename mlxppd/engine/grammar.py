"""Grammar-constrained sampling on the last stage: JSON Schema and JSON-object output.

The engine is llguidance; docs/structured-output.md has the measurements behind that choice.
Its tokenizer-side structure (a token trie over the vocabulary) takes about 0.2 s to build for
a 49k vocabulary, so :class:`GrammarCompiler` builds it once per tokenizer object and keeps it
for the process. A schema compiles into a grammar that llguidance extends
lazily as tokens arrive, so compiling one per request is cheap.

A :class:`Constraint` is one sequence's matcher. For each token the matcher writes the allowed
set as a bitmask (one bit per token id, 32 ids per int32 word) into the constraint's own numpy
buffer; :meth:`Constraint.apply` unpacks it into one boolean row and selects ``-inf`` where a
bit is clear: one O(V) pass on the logits whether few or many tokens are disallowed, a fraction
of the log-softmax that follows it, and none at all when every token is allowed. The mask is
computed once per state, eagerly at the end of :meth:`Constraint.advance` (while the matcher's
tables are still in cache), and the next advance checks the sampled token against it.

The logits may be wider than the tokenizer's vocabulary (an embedding padded to a multiple of
64): the tokenizer is given the logits width, so the padding ids have no bytes and are never
allowed. Once a complete value has been produced, only the tokenizer's EOS ids are allowed.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import llguidance
import mlx.core as mx
import numpy as np

from mlxppd.core.protocol.sampling import MAX_SCHEMA_BYTES  # refused before compiling

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

#: schemas nested deeper than this (objects and arrays of the schema document) are refused
MAX_SCHEMA_DEPTH = 32


def _options(*, lenient: bool) -> JsonCompileOptions:
    """Compact JSON with one space after ':' and ',' (as json.dumps writes it) and no free
    whitespace: free whitespace lets a sampled model pad forever inside a valid value; these
    separators keep the text close to what the model saw in training. ``lenient`` ignores the
    keywords llguidance does not implement instead of refusing the schema."""
    return {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": lenient,
    }


class Constraint:
    """One sequence's grammar state: masks logits, follows the sampled tokens."""

    def __init__(self, matcher: Any, eos: tuple[int, ...], vocab_size: int):
        self._matcher = matcher
        self._eos = eos
        self._vocab = vocab_size
        self._words = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
        # The allowed row for the current state; None until apply() or advance() needs it.
        self._allowed: np.ndarray | None = None
        self._all_allowed = False
        self._ended = False

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` ([1, V]) with every token the grammar does not allow at ``-inf``."""
        if logits.shape[-1] != self._vocab:
            raise ValueError(f"logits are {logits.shape[-1]} wide, the constraint {self._vocab}")
        row = self._allowed_row()
        if self._all_allowed:
            return logits
        # A Python scalar is weakly typed: the result keeps the logits' dtype.
        return mx.where(mx.array(row)[None], logits, -mx.inf)

    def advance(self, token: int) -> None:
        """Follow ``token``; ValueError (state unchanged) if the grammar did not allow it."""
        if not 0 <= token < self._vocab or not self._allowed_row()[token]:
            raise ValueError(f"token {token} is not allowed by the grammar here")
        self._allowed = None
        if self._ended or (token in self._eos and self.is_finished()):
            self._ended = True
            return
        if not self._matcher.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self._matcher.get_error()}")
        # The next mask now, while the matcher's tables are still in cache: by the next
        # apply() the model's forward pass has streamed its weights through every cache
        # level, and the same mask then costs several times more (docs/structured-output.md).
        self._allowed_row()

    def follow(self, tokens: Sequence[int]) -> None:
        """Follow ``tokens`` at once: a replayed sequence's output so far, which its new copy
        of the grammar must have seen before the next draw. ValueError (state unchanged) if
        the grammar does not allow them; no mask is computed on the way."""
        ids = list(tokens)
        if bad := [t for t in ids if not 0 <= t < self._vocab]:
            raise ValueError(f"replayed token {bad[0]} is outside the vocabulary of {self._vocab}")
        allowed = self._matcher.validate_tokens(ids) if ids else 0
        if allowed < len(ids):
            raise ValueError(
                f"replayed token {allowed} of {len(ids)} (id {ids[allowed]}) is not allowed by "
                "the grammar there"
            )
        if ids and not self._matcher.consume_tokens(ids):
            raise ValueError(
                f"the grammar refused the replayed tokens: {self._matcher.get_error()}"
            )
        self._allowed = None

    def is_finished(self) -> bool:
        """A complete value has been produced: only EOS may follow."""
        return self._ended or bool(self._matcher.is_stopped())

    def copy(self) -> Constraint:
        """An independent constraint in the same state (for n > 1 choices of one prompt)."""
        twin = Constraint(self._matcher.deep_copy(), self._eos, self._vocab)
        twin._ended = self._ended
        return twin

    @property
    def error(self) -> str | None:
        """Why the matcher stopped early (a resource limit), or None; only EOS follows one."""
        return cast(str, self._matcher.get_error()) or None

    def _allowed_row(self) -> np.ndarray:
        """The allowed tokens of the current state as a boolean row, computed once per state."""
        if self._allowed is not None:
            return self._allowed
        if self.is_finished() or self._matcher.is_error():
            # A stopped or failed matcher allows only EOS: the sequence ends there.
            row = np.zeros(self._vocab, dtype=np.bool_)
            row[list(self._eos)] = True
        else:
            # llguidance drops the GIL here and writes the bitmask straight into our buffer.
            self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
            row = bits[: self._vocab].view(np.bool_)
        # Nothing to mask (free text inside a string, say): apply() hands the logits back.
        self._all_allowed = bool(row.all())
        self._allowed = row
        return row


class GrammarCompiler:
    """Compiles schemas for one tokenizer; built once per tokenizer object (see for_tokenizer)."""

    _built: weakref.WeakKeyDictionary[Any, dict[int, GrammarCompiler]] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, vocab_size: int):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise ValueError("structured output needs a Hugging Face fast (tokenizers) tokenizer")
        eos = tuple(sorted(int(t) for t in getattr(tokenizer, "eos_token_ids", ()) or ()))
        if not eos:
            raise ValueError("structured output needs a tokenizer with an EOS token")
        try:
            self._tokenizer = _ll_tokenizer(backend.to_str(), vocab_size, eos)
        except Exception as e:  # llguidance raises plain ValueError/RuntimeError from Rust
            raise ValueError(f"llguidance cannot use this tokenizer: {e}") from e
        # Per-token work limits (llguidance's defaults, named here): past them the matcher
        # errors and the sequence ends at EOS rather than stalling everyone's decode step.
        # verbose_errors off: an error message never echoes the grammar back to the client.
        self._limits = llguidance.LLParserLimits(
            step_lexer_fuel=200_000, step_max_items=50_000, verbose_errors=False
        )
        self.eos = eos
        self.vocab_size = vocab_size

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> GrammarCompiler:
        """The compiler for ``tokenizer`` with logits ``vocab_size`` wide, built on first use."""
        with cls._lock:  # one build per tokenizer even when two requests race for it
            per_width = cls._built.setdefault(tokenizer, {})
            if vocab_size not in per_width:
                per_width[vocab_size] = cls(tokenizer, vocab_size)
            return per_width[vocab_size]

    def json_schema(self, schema: dict[str, Any], *, strict: bool = True) -> Constraint:
        """Output that validates against ``schema``. ``strict``: a keyword the engine cannot
        enforce is an error (ValueError); otherwise it is ignored and the rest enforced."""
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema is a JSON object")
        text = _checked_text(schema)
        return self._compile(text, _options(lenient=not strict))

    def json_object(self) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return self._compile('{"type": "object"}', _options(lenient=False))

    def _compile(self, schema_text: str, options: JsonCompileOptions) -> Constraint:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults=options)
        except ValueError as e:
            raise ValueError(f"the schema cannot be compiled: {_one_line(e)}") from e
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(f"unsupported or invalid schema: {_one_line(matcher.get_error())}")
        return Constraint(matcher, self.eos, self.vocab_size)


def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]) -> Any:
    """llguidance's tokenizer, every EOS id allowed wherever the value may end. llguidance 1.6
    takes a single EOS id: there only the first can end a value that could go on (a number),
    and once a value is complete every EOS id is allowed as everywhere else."""
    try:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))
    except TypeError:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos[0])


def _checked_text(schema: dict[str, Any]) -> str:
    """``schema`` as compact JSON, after the depth and size limits (depth first: json.dumps
    of a very deep document would hit Python's recursion limit)."""
    _check_shape(schema)
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the schema is not plain JSON: {e}") from e
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise ValueError(f"the schema is over {MAX_SCHEMA_BYTES // 1024} KiB of JSON")
    return text


def _check_shape(schema: dict[str, Any]) -> None:
    """Depth and node count, walked without recursion and stopped at the first excess: every
    node takes at least one byte of JSON, so more nodes than the byte limit is too large."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        node, level = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_BYTES:
            raise ValueError(f"the schema is over {MAX_SCHEMA_BYTES // 1024} KiB of JSON")
        if isinstance(node, dict | list):
            if level > MAX_SCHEMA_DEPTH:
                raise ValueError(f"the schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, level + 1) for child in children)


def _one_line(error: object) -> str:
    """An engine message as one line (a regex error spans several), at most 200 characters."""
    text = " ".join(str(error).split()) or "unknown error"
    return text if len(text) <= 200 else text[:199] + "…"
