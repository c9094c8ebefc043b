"""One stage's output grammars: compiled on worker threads of their own, cached by schema digest,
each sequence given its own copy advanced over what it already produced.

The last stage needs a matcher for every constrained sequence it admits. Loading the tokenizer
(seconds), building llguidance's token trie (a fraction of one) and compiling a large schema
(a second and more for an ``anyOf`` of hundreds of formatted strings) must not run on the
stage's event loop, which also answers the coordinator's heartbeats, nor on its mlx thread,
which runs every forward pass. Here they run on a small pool (``workers`` threads: the bound on
compiles at once per stage), and a schema compiles once: the ``n`` choices of a request, and
later requests with the same schema, copy the compiled matcher (a copy costs microseconds).

A compile that takes longer than ``limit_s`` is remembered as refused, so the same schema is
refused at once the next time instead of taking a worker again; the caller bounds its own wait
by the same limit (a compile already running cannot be stopped: llguidance's own limits bound
its work). Results are ``concurrent.futures`` futures: the caller chooses how it waits.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from mlxppd.core.config.cluster import DEFAULT_GRAMMAR_COMPILE_LIMIT_S
from mlxppd.core.protocol.sampling import GrammarSpec
from mlxppd.engine.grammar import Constraint, GrammarCompiler
from mlxppd.engine.sampling import constraint_for

#: how a schema compiles: (grammar, tokenizer, logits width) -> its matcher
CompileFn = Callable[[GrammarSpec, Any, int], Constraint | None]
#: compiles one stage runs at once
COMPILE_WORKERS = 2
#: compiled schemas (and refusals) a stage keeps, least recently used dropped first
CACHED_GRAMMARS = 16


class GrammarTooSlow(ValueError):
    """A schema did not compile within the stage's grammar compile limit."""


class GrammarCompiles:
    """The grammar pool of one stage: ``ready``, then ``compiled``, then ``instance``."""

    def __init__(
        self,
        tokenizer: Callable[[], Any] | None,
        limit_s: float = DEFAULT_GRAMMAR_COMPILE_LIMIT_S,
        *,
        workers: int = COMPILE_WORKERS,
        entries: int = CACHED_GRAMMARS,
        compile: CompileFn = constraint_for,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``tokenizer``: loads the model's tokenizer (None: this stage cannot constrain)."""
        self.limit_s = limit_s
        self._load = tokenizer
        self._compile = compile
        self._clock = clock
        self._entries_max = entries
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()  # the pool's threads finish futures while callers look
        self._ready: dict[int, Future[Any]] = {}
        self._compiled: OrderedDict[str, Future[Constraint]] = OrderedDict()

    @property
    def too_slow(self) -> str:
        """The refusal of a schema that did not compile in time, naming the limit and the fix."""
        return (
            f"the output schema did not compile within the grammar compile limit of "
            f"{self.limit_s:g} s ([cluster] grammar_compile_limit_s); simplify the schema "
            "(fewer anyOf alternatives, string formats or patterns), or raise the limit"
        )

    def ready(self, vocab: int) -> Future[Any]:
        """The tokenizer, loaded and its token trie built for logits ``vocab`` wide: once per
        stage, started by the first call (a dry run starts it while the other stages answer)."""
        with self._lock:
            future = self._ready.get(vocab)
            if future is None:
                future = self._ready[vocab] = self._pool.submit(self._prepare, vocab)
            return future

    def compiled(self, grammar: GrammarSpec, tokenizer: Any, vocab: int) -> Future[Constraint]:
        """The compiled matcher of ``grammar`` in its initial state (never advanced: copy it
        with ``instance``); the same schema shares one compile, running or done."""
        key = digest(grammar, vocab)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
                return future
            future = self._pool.submit(self._timed, grammar, tokenizer, vocab)
            self._compiled[key] = future
            while len(self._compiled) > self._entries_max:
                self._compiled.popitem(last=False)  # its waiters hold their own reference
            return future

    def instance(self, compiled: Constraint, replay: Sequence[int] = ()) -> Future[Constraint]:
        """One sequence's matcher: a copy of ``compiled`` that has followed ``replay`` (a
        replayed sequence's tokens sent before a failover, ``SamplerSpec.replay``)."""
        return self._pool.submit(_advanced_copy, compiled, tuple(replay))

    def close(self) -> None:
        """Queued work is dropped; a compile already running ends on its own."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _prepare(self, vocab: int) -> Any:
        if self._load is None:
            raise ValueError("this stage has no tokenizer to constrain output with")
        tokenizer = self._load()
        GrammarCompiler.for_tokenizer(tokenizer, vocab)  # the trie, before any schema's clock
        return tokenizer

    def _timed(self, grammar: GrammarSpec, tokenizer: Any, vocab: int) -> Constraint:
        started = self._clock()
        constraint = self._compile(grammar, tokenizer, vocab)
        if self._clock() - started > self.limit_s:
            raise GrammarTooSlow(self.too_slow)
        if constraint is None:
            raise ValueError("no grammar to compile")
        return constraint


def digest(grammar: GrammarSpec, vocab: int) -> str:
    """What a compiled grammar is cached under: its kind, schema text, strictness and width."""
    text = f"{vocab}\n{grammar.model_dump_json()}"
    return hashlib.sha256(text.encode()).hexdigest()


def _advanced_copy(compiled: Constraint, replay: tuple[int, ...]) -> Constraint:
    constraint = compiled.copy()
    if replay:
        constraint.follow(replay)
    return constraint
