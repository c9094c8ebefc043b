"""Per-token cost of grammar-constrained sampling, per engine, beside the model's own decode.

    .venv/bin/python bench/grammar.py [--model DIR] [--tokens 200] [--engines a,b,...]

For each grammar engine (llguidance, xgrammar, outlines-core, and mlxpp's own
``mlxppd.engine.grammar`` on its chosen engine) and two constraints, (a) a JSON schema with a
string, an integer with minimum/maximum, an enum and an array of small objects, and (b) plain
JSON-object mode, generates from the real model at temperature 1 (seeds 0, 1, ...) until at
least ``--tokens`` constrained tokens have been drawn. Per token it times, each step evaluated:
writing the allowed-token bitmask (right after the matcher advanced, while its tables are
still in cache, as mlxppd.engine.grammar does), applying it to the [1, V] mx.array of logits
(-inf where disallowed; the same unpack-and-where code for every engine) and advancing the
matcher with the sampled token; the model's forward pass plus the draw is timed apart.
Unconstrained generations of the same prompts, interleaved with the constrained ones (seed by
seed, every engine in turn) so a noisy neighbour slows all rows alike, give the baseline decode
time; the ratio is the median overhead over that baseline. A replay table then runs every
sampled sequence through each engine without the model (mask + advance only), and a last table
gives the setup costs (tokenizer-side structures, once per tokenizer; each grammar's
compilation). An engine that is not installed is reported and skipped: xgrammar cannot be
imported without torch, which the project does not install.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxppd.engine.blas import use_optimized_blas

# Before mlx is imported: the BLAS under every row is the one mlxppd would use.
BLAS = use_optimized_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from mlxppd.core.cpu_weights import CpuWeights  # noqa: E402
from mlxppd.core.profile.model import read_model_config  # noqa: E402
from mlxppd.engine.cpu_weights import resolve_for_process  # noqa: E402
from mlxppd.engine.model_files import resolve_model_dir  # noqa: E402
from mlxppd.engine.tokenizer import encode_prompt, load_tokenizer  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "artist", "teacher", "doctor"]},
        "pets": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "maxLength": 16},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                },
                "required": ["kind", "legs"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "role", "pets"],
    "additionalProperties": False,
}
OBJECT: dict[str, Any] = {"type": "object"}
CASES = {
    "schema": (SCHEMA, "Describe a person as JSON: name, age, role and their pets."),
    "json_object": (OBJECT, "Give me a JSON object describing a book you like."),
}
#: a generation stops here even if the value is unfinished
MAX_PER_GENERATION = 256


def unpack(words: np.ndarray, vocab: int) -> mx.array:
    """A [1, W] int32 bitmask as a [1, vocab] boolean mx.array (what every engine row uses)."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    return mx.array(bits.view(np.bool_))[None]


def masked(logits: mx.array, allowed: mx.array) -> mx.array:
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


class Matcher:
    """One generation's constraint: ``mask`` (write the engine's bitmask), ``apply`` (it, to
    the logits), ``advance``, ``finished``."""

    mask: Callable[[], object]
    apply: Callable[[mx.array], mx.array]
    advance: Callable[[int], None]
    finished: Callable[[], bool]


def check(accepted: bool, token: int) -> None:
    if not accepted:
        raise ValueError(f"the matcher refused token {token}")


def llguidance_engine(hf: Any, eos: list[int], vocab: int) -> Callable[[dict[str, Any]], Any]:
    import llguidance
    import llguidance.numpy as lnp

    tok = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def compile_(schema: dict[str, Any]) -> Callable[[], Matcher]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        llguidance.LLMatcher(tok, grammar, log_level=0)  # compile once (validates)

        def new() -> Matcher:
            m = llguidance.LLMatcher(tok, grammar, log_level=0)
            words = lnp.allocate_token_bitmask(1, vocab)
            out = Matcher()

            out.mask = lambda: lnp.fill_next_token_bitmask(m, words)
            out.apply = lambda logits: masked(logits, unpack(words, vocab))
            out.advance = lambda t: check(m.consume_token(t), t)
            out.finished = m.is_stopped
            return out

        return new

    return compile_


def xgrammar_engine(hf: Any, eos: list[int], vocab: int) -> Callable[[dict[str, Any]], Any]:
    import xgrammar as xg

    info = xg.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xg.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile_(schema: dict[str, Any]) -> Callable[[], Matcher]:
        compiled = compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )

        def new() -> Matcher:
            m = xg.GrammarMatcher(compiled)
            words = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
            out = Matcher()

            out.mask = lambda: m.fill_next_token_bitmask(words)
            out.apply = lambda logits: masked(logits, unpack(words, vocab))
            out.advance = lambda t: check(m.accept_token(t), t)
            out.finished = m.is_terminated
            return out

        return new

    return compile_


def byte_level_vocabulary(hf: Any) -> dict[bytes, list[int]]:
    """Token id -> bytes for a GPT-2 style byte-level BPE vocabulary (special tokens left out)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    decode = {chr(c): b for b, c in zip(printable, chars, strict=True)}
    special = set(hf.all_special_ids) | set(hf.added_tokens_decoder)
    out: dict[bytes, list[int]] = {}
    for token, i in hf.get_vocab().items():
        if i not in special and all(ch in decode for ch in token):
            out.setdefault(bytes(decode[ch] for ch in token), []).append(i)
    return out


def outlines_engine(hf: Any, eos: list[int], vocab: int) -> Callable[[dict[str, Any]], Any]:
    import outlines_core as oc

    vocabulary = oc.Vocabulary(eos[0], byte_level_vocabulary(hf))

    def compile_(schema: dict[str, Any]) -> Callable[[], Matcher]:
        text = json.dumps(schema)
        regex = oc.json_schema.build_regex_from_schema(text, whitespace_pattern="[ ]?")
        index = oc.Index(regex, vocabulary)

        def new() -> Matcher:
            g = oc.Guide(index)
            words = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
            out = Matcher()

            out.mask = lambda: g.write_mask_into(words.ctypes.data, words.size, words.itemsize)
            out.apply = lambda logits: masked(logits, unpack(words, vocab))
            out.advance = lambda t: None if t in eos else g.advance(t, return_tokens=False)
            out.finished = g.is_finished
            return out

        return new

    return compile_


def mlxpp_engine(tokenizer: Any, vocab: int) -> Callable[[dict[str, Any]], Any]:
    from mlxppd.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler.for_tokenizer(tokenizer, vocab)

    def compile_(schema: dict[str, Any]) -> Callable[[], Matcher]:
        def new() -> Matcher:
            c = compiler.json_object() if schema is OBJECT else compiler.json_schema(schema)
            out = Matcher()
            out.mask = lambda: None  # Constraint.advance computes the next mask itself
            out.apply, out.advance, out.finished = c.apply, c.advance, c.is_finished
            return out

        new()  # compile once, as the others do in compile_
        return new

    return compile_


@dataclass
class Cell:
    new: Callable[[], Matcher] | None
    overhead_us: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)
    apply_us: list[float] = field(default_factory=list)
    advance_us: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    finished: int = 0
    runs: int = 0
    sequences: list[list[int]] = field(default_factory=list)


def generate(model: Any, prompt: list[int], seed: int, matcher: Matcher | None, cell: Cell) -> None:
    """One generation at temperature 1; appends its per-token timings to ``cell``. Each mask
    is computed right after the matcher advances (the first before the prompt's forward pass),
    as mlxppd.engine.grammar does: the matcher's tables are still in cache then."""
    cache = make_prompt_cache(model)
    tm = time.perf_counter()
    if matcher is not None:
        matcher.mask()
    mask_us = (time.perf_counter() - tm) * 1e6
    logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    key = mx.random.key(seed)
    limit = MAX_PER_GENERATION if matcher else 32
    cell.sequences.append([])
    for _ in range(limit):
        t0 = time.perf_counter()
        if matcher is not None:
            logits = matcher.apply(logits)
            mx.eval(logits)
        t1 = time.perf_counter()
        key, sub = mx.random.split(key)
        token = mx.random.categorical(logits, key=sub)
        value = int(token.item())
        cell.sequences[-1].append(value)
        t2 = time.perf_counter()
        if matcher is not None:
            matcher.advance(value)
            ta = time.perf_counter()
            finished = matcher.finished()
            if not finished:
                matcher.mask()
            tb = time.perf_counter()
            cell.mask_us.append(mask_us)
            cell.apply_us.append((t1 - t0) * 1e6)
            cell.advance_us.append((ta - t2) * 1e6)
            cell.overhead_us.append(mask_us + ((t1 - t0) + (ta - t2)) * 1e6)
            mask_us = (tb - ta) * 1e6
            if finished:
                cell.finished += 1
                break
        t3 = time.perf_counter()
        logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]
        mx.eval(logits)
        t4 = time.perf_counter()
        cell.decode_ms.append(((t2 - t1) + (t4 - t3)) * 1e3)
    cell.runs += 1


def replay(new: Callable[[], Matcher], sequences: list[list[int]], repeats: int) -> list[float]:
    """Mask + advance µs per token of ``new``'s engine over recorded token sequences (each
    repeated ``repeats`` times); a sequence the engine refuses stops at the refused token."""
    times: list[float] = []
    for _ in range(repeats):
        for sequence in sequences:
            matcher = new()
            for token in sequence:
                start = time.perf_counter()
                matcher.mask()
                try:
                    matcher.advance(token)
                except Exception:  # noqa: BLE001 - engines raise their own error types
                    break
                times.append((time.perf_counter() - start) * 1e6)
                if matcher.finished():
                    break
    return times


def p95(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.95 * len(values)))]


def report(cells: dict[tuple[str, str], Cell]) -> None:
    print(
        "| engine | constraint | tokens (runs, finished) | mask µs median / p95 | apply µs "
        "| advance µs | mask+apply+advance µs median | p95 | decode ms/token "
        "| overhead / unconstrained decode |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (name, case), cell in cells.items():
        if not cell.decode_ms:
            continue
        base = statistics.median(cells[("unconstrained", case)].decode_ms)
        decode = statistics.median(cell.decode_ms)
        if cell.new is None:
            runs = f"{len(cell.decode_ms)} ({cell.runs})"
            print(f"| {name} | {case} | {runs} | | | | | | {decode:.2f} | |")
            continue
        med = statistics.median(cell.overhead_us)
        mask = f"{statistics.median(cell.mask_us):.0f} / {p95(cell.mask_us):.0f}"
        print(
            f"| {name} | {case} | {len(cell.overhead_us)} ({cell.runs}, {cell.finished}) "
            f"| {mask if name != 'mlxpp' else 'in advance'} "
            f"| {statistics.median(cell.apply_us):.0f} "
            f"| {statistics.median(cell.advance_us):.0f} | {med:.0f} | {p95(cell.overhead_us):.0f} "
            f"| {decode:.2f} | {med / 1e3 / base:.1%} |"
        )


def build_cells(
    engines: list[str], builders: dict[str, Callable[[], Callable[[dict[str, Any]], Any]]]
) -> tuple[dict[tuple[str, str], Cell], list[str]]:
    """A cell per (engine, constraint), and the setup table's rows (build and compile times)."""
    setup: list[str] = []
    cells: dict[tuple[str, str], Cell] = {("unconstrained", c): Cell(None) for c in CASES}
    for name in engines:
        try:
            start = time.perf_counter()
            compile_ = builders[name]()
            built = time.perf_counter() - start
        except ImportError as e:
            setup.append(f"| {name} | not installed ({e}) | | |")
            continue
        times = []
        for case, (schema, _) in CASES.items():
            start = time.perf_counter()
            try:
                cells[(name, case)] = Cell(compile_(schema))
                times.append(f"{(time.perf_counter() - start) * 1e3:.0f} ms")
            except Exception as e:  # noqa: BLE001 - an engine that cannot compile is reported
                times.append(f"fails: {str(e).splitlines()[0][:80]}")
        setup.append(f"| {name} | {built * 1e3:.0f} ms | {times[0]} | {times[1]} |")
        print(f"{name} built", file=sys.stderr, flush=True)
    return cells, setup


def replay_table(cells: dict[tuple[str, str], Cell], repeats: int) -> None:
    """Every constrained token sequence drawn above, replayed through every engine."""
    print(
        f"\nReplay, without the model: every sequence drawn above through each engine "
        f"({repeats} passes); mask + advance µs per token\n"
    )
    print("| engine | constraint | tokens | median | p95 | mean |")
    print("|---|---|---:|---:|---:|---:|")
    for case in CASES:
        drawn = [
            q for (n, c), cell in cells.items() if c == case and cell.new for q in cell.sequences
        ]
        for (name, c), cell in cells.items():
            if c != case or cell.new is None or name == "mlxpp":
                continue
            t = replay(cell.new, drawn, repeats)
            print(
                f"| {name} | {case} | {len(t) // repeats} of {sum(map(len, drawn))} "
                f"| {statistics.median(t):.0f} | {p95(t):.0f} | {statistics.fmean(t):.0f} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: embedded model)")
    parser.add_argument("--tokens", type=int, default=200, help="constrained tokens per cell")
    parser.add_argument("--engines", default="llguidance,xgrammar,outlines-core,mlxpp")
    parser.add_argument("--replays", type=int, default=5, help="passes of the replay table")
    args = parser.parse_args(argv)

    model_dir = resolve_model_dir(args.model)
    config = read_model_config(model_dir)
    model, _ = load_model(model_dir)
    if resolve_for_process(CpuWeights.AUTO, config)[0] is CpuWeights.FLOAT32:
        from mlx_lm.utils import dequantize_model

        dequantize_model(model)  # held as a served stage holds it on this host
        model.set_dtype(mx.float32)
    tokenizer = load_tokenizer(model_dir)
    hf, vocab = tokenizer._tokenizer, int(config["vocab_size"])
    eos = sorted(tokenizer.eos_token_ids)
    builders: dict[str, Callable[[], Callable[[dict[str, Any]], Any]]] = {
        "llguidance": lambda: llguidance_engine(hf, eos, vocab),
        "xgrammar": lambda: xgrammar_engine(hf, eos, vocab),
        "outlines-core": lambda: outlines_engine(hf, eos, vocab),
        "mlxpp": lambda: mlxpp_engine(tokenizer, vocab),
    }
    cells, setup = build_cells(args.engines.split(","), builders)

    prompts = {c: encode_prompt(tokenizer, q, chat_template=True) for c, (_, q) in CASES.items()}
    seed = 0
    while any(c.new and len(c.overhead_us) < args.tokens for c in cells.values()):
        for (name, case), cell in cells.items():
            if name == "unconstrained" or (cell.new and len(cell.overhead_us) < args.tokens):
                generate(model, prompts[case], seed, cell.new() if cell.new else None, cell)
        print(f"seed {seed} done", file=sys.stderr, flush=True)
        seed += 1

    print(f"Grammar-constrained sampling, {model_dir.name} (V = {vocab}), BLAS: {BLAS}\n")
    report(cells)
    replay_table(cells, args.replays)
    print("\n| engine | tokenizer structures (once) | compile schema (a) | compile json_object |")
    print("|---|---:|---:|---:|")
    print("\n".join(setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
