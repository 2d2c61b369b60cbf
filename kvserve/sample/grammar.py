"""Structured output: constraints compiled by xgrammar, and the logits processor that masks every token a
request's constraint forbids, before every other processor.

``StructuredOutputCompiler`` turns a request's ``StructuredOutputsParams`` (a JSON schema, any JSON object, a
regex, a choice among strings, an EBNF grammar) into xgrammar's compiled grammar for the model's tokenizer;
compiled grammars are kept by their text, so a schema many requests share is compiled once, up to
``GRAMMAR_CACHE_BYTES`` as xgrammar counts them, least recently used out. The cache is ours: xgrammar's own,
bounded the same way, grew the process by ~0.2 MB a new schema on the default model after it was full (its
evictions gave nothing back), where compiled grammars that are dropped are freed. A request holds its compiled
grammar while it lives (``Request.grammar``) and the compiler tracks it weakly, so one evicted while its request
waits (a queue of more distinct schemas than the cache holds) is found again, not compiled a second time on the
engine thread when the request is scheduled. The
frontend compiles each constrained request when it arrives, so a constraint that does not compile is the
client's 400, never a failed step. ``GrammarProcessor`` keeps one matcher per sample (created from the
sample's outputs so far, advanced past each drawn token, dropped when the request ends; an n > 1 request's
samples are made before its first draw, so each makes its own):
a recompute preemption keeps the outputs, so the matcher stays where it was. Once a matcher has accepted a
complete match it allows only the stop tokens, so the request ends with EOS.

The masks of a step depend only on the tokens accepted so far, so ``prepare`` (called before the forward
pass) fills them on a worker thread while the model runs (xgrammar releases the GIL), and ``apply`` only
waits for them, which costs nothing when they were faster than the forward. ``stats`` reports the time spent
filling masks and the time the step waited for them. A speculating request's rows (its history extended by
one more draft token each) are masked by walking its matcher along the draft, a token per row, and rolling
it back afterwards: only ``accept`` moves a matcher for good.

xgrammar and the tokenizer's vocabulary table are loaded on first use: an engine that never sees a constraint
never pays for them.
"""

from __future__ import annotations

import json
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Sequence

import torch

from kvserve.sample.json_schema import check_enforceable, with_json_string_characters
from kvserve.sample.metadata import SamplingRow
from kvserve.sample.processor import LogitsProcessor
from kvserve.sample.token_mask import apply_token_mask
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.utf8 import check_utf8

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

# compiled grammars kept for reuse, by xgrammar's count of their bytes (~1,000 schemas on a 49k vocabulary); a
# process compiling 1,000 distinct schemas under a 32 MB bound grew 35 MB, then stayed
GRAMMAR_CACHE_BYTES = 256 * 2**20
# The longest constraint compiled (a schema's JSON text, a regex, a grammar, the choices together): xgrammar's time
# and memory grow faster than its size (a 32 KB regex compiled in 0.15 s on a 49k vocabulary, a 1 MB choice took
# minutes; 40,000 EBNF rules, 1.6 MB, passed 7 GB)
MAX_CONSTRAINT_CHARS = 65_536


def _schema_object(schema: dict[str, Any] | str) -> Any:
    """A JSON schema given as an object or as its text, as an object."""
    if not isinstance(schema, str):
        return schema
    try:
        return json.loads(schema)
    except json.JSONDecodeError as error:
        raise ValueError(f"structured output: the JSON schema is not JSON: {error}") from None


def _checked_text(spec: StructuredOutputsParams, text: str) -> str:
    """``text`` (the constraint as compiled), or ValueError if it is longer than ``MAX_CONSTRAINT_CHARS`` or is
    no valid UTF-8 (a lone surrogate: JSON's "\\ud800", which xgrammar's C++ cannot take)."""
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured output: the {spec.kind} is {len(text):,} characters long; at most "
                         f"{MAX_CONSTRAINT_CHARS:,} are compiled")
    return check_utf8(text, f"structured output: the {spec.kind}")


def _json_schema_grammar(schema: str) -> xgrammar.Grammar:
    """xgrammar's grammar of a JSON schema (compact: no whitespace beyond one after ':' and ','), its length-bounded
    strings' characters written as JSON's (``with_json_string_characters``)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    ebnf = str(grammar)
    fixed = with_json_string_characters(ebnf)
    return grammar if fixed is ebnf else xgrammar.Grammar.from_ebnf(fixed)


class StructuredOutputCompiler:
    """Compiles constraints for one tokenizer and a vocabulary of ``vocab_size`` (the logits' width)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._info: xgrammar.TokenizerInfo | None = None
        self._lock = threading.Lock()  # the frontend and the runner may compile at once
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()  # by (kind, text)
        # every compiled grammar still held anywhere (the cache, a request): by (kind, text)
        self._alive: weakref.WeakValueDictionary[tuple[str, str], xgrammar.CompiledGrammar] = \
            weakref.WeakValueDictionary()
        self.cache_bytes = 0  # of the grammars in the cache, as xgrammar counts them

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar (the one compiled before from the same text, where the cache or a request still
        holds it); ValueError naming the problem if the constraint does not compile."""
        key = self._key(spec)
        held = self._held(key)
        if held is not None:
            return held
        compiler = self._get_compiler()
        kind, text = key
        try:
            compiled = (compiler.compile_grammar(_json_schema_grammar(text)) if kind == "json"
                        else compiler.compile_regex(text) if kind == "regex" else compiler.compile_grammar(text))
        except RuntimeError as error:  # xgrammar reports a bad schema, regex or grammar as a RuntimeError
            raise ValueError(f"structured output: the {spec.kind} does not compile: {_xgrammar_message(error)}") \
                from None
        self._keep(key, compiled)
        return compiled

    def is_cached(self, spec: StructuredOutputsParams) -> bool:
        """Whether ``spec``'s grammar is compiled and still held (by the cache or a request); ValueError if it is
        refused before compiling."""
        key = self._key(spec)
        with self._lock:
            return key in self._alive

    def _held(self, key: tuple[str, str]) -> xgrammar.CompiledGrammar | None:
        """The grammar compiled for ``key`` if anything holds it, made the cache's most recent (back in the cache
        if it had been evicted); None if it must be compiled."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            held = self._alive.get(key)
        if held is not None:
            self._keep(key, held)
        return held

    @staticmethod
    def _key(spec: StructuredOutputsParams) -> tuple[str, str]:
        """What xgrammar compiles for ``spec``: ("json" | "regex" | "grammar", its text), checked for size (and a
        schema for keywords xgrammar would not enforce)."""
        if spec.json is not None:
            try:
                schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json, ensure_ascii=False,
                                                                                     separators=(",", ":"))
                _checked_text(spec, schema)
                check_enforceable(_schema_object(spec.json))
            except RecursionError:  # offline: a server's body parser refuses such nesting first
                raise ValueError("structured output: the JSON schema is nested too deeply to check") from None
            return "json", schema
        if spec.json_object:  # OpenAI's json_object: a JSON object (xgrammar's builtin takes any value)
            return "json", '{"type": "object"}'
        if spec.regex is not None:
            return "regex", _checked_text(spec, spec.regex)
        if spec.choice is not None:
            # each choice an EBNF string literal; ensure_ascii would write a character past U+FFFF as two
            # surrogate escapes, which xgrammar reads as two code points of their own (invalid UTF-8 forced)
            literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return "grammar", "root ::= " + _checked_text(spec, literals)
        assert spec.grammar is not None
        return "grammar", _checked_text(spec, spec.grammar)

    def _keep(self, key: tuple[str, str], compiled: xgrammar.CompiledGrammar) -> None:
        with self._lock:
            if key in self._cache:  # compiled at once by two threads
                return
            self._cache[key] = compiled
            self._alive[key] = compiled
            self.cache_bytes += compiled.memory_size_bytes
            while self.cache_bytes > GRAMMAR_CACHE_BYTES and len(self._cache) > 1:
                self.cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                self._info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids or None
                )
                self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=2, cache_enabled=False)
            return self._compiler

    def stop_token_ids(self) -> list[int]:
        """The tokens that end a document (the tokenizer's, as xgrammar found them)."""
        self._get_compiler()
        assert self._info is not None
        return list(self._info.stop_token_ids)


@dataclass
class MaskStats:
    """Where structured output's time went: masks filled (rows, seconds on the worker thread) and what the
    steps waited for them after the forward pass."""

    steps: int = 0
    rows: int = 0
    fill_seconds: float = 0.0
    wait_seconds: float = 0.0


class _Masks(NamedTuple):
    bitmask: torch.Tensor  # int32 [N, ceil(V / 32)], xgrammar's layout
    selected: list[int]  # the rows it constrains
    seconds: float  # time to fill them


class GrammarProcessor(LogitsProcessor):
    """Sets to -inf the logits of every token the row's constraint forbids next. A constraint with a
    ``begins_after_token_id`` (a reasoning model's end of thinking) waits, its row free, until that token is
    sampled: its matcher starts with the tokens after it."""

    is_stateful: ClassVar[bool] = True

    def __init__(self, compiler: StructuredOutputCompiler) -> None:
        self.compiler = compiler
        self.stats = MaskStats()
        self._matchers: dict[str, Any] = {}
        self._gates: dict[str, int] = {}  # matchers still waiting for their begins_after_token_id
        self._worker: ThreadPoolExecutor | None = None  # started by the first constrained step
        self._pending: tuple[Sequence[SamplingRow], Future[_Masks]] | None = None
        self._stop_only: torch.Tensor | None = None  # the mask row of a finished document

    def is_needed(self, row: SamplingRow) -> bool:
        return row.params.structured_outputs is not None

    def add(self, key: str, row: SamplingRow) -> None:
        if row.params.structured_outputs is None:
            return
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self.compiler.compile(row.params.structured_outputs))
        self._matchers[key] = matcher
        gate = row.params.structured_outputs.begins_after_token_id
        if gate is not None:
            self._gates[key] = gate
        self.accept(key, row.output_token_ids)  # a sample that already has outputs (a resumed request)

    def accept(self, key: str, token_ids: Sequence[int]) -> None:
        matcher = self._matchers.get(key)
        if matcher is None:
            return
        gate = self._gates.get(key)
        if gate is not None:
            begin = _after(token_ids, gate)
            if begin is None:
                return
            del self._gates[key]
            token_ids = token_ids[begin:]
        for token_id in token_ids:
            if not matcher.is_terminated():
                matcher.accept_token(int(token_id))

    def drop(self, key: str) -> None:
        self._matchers.pop(key, None)
        self._gates.pop(key, None)

    @property
    def num_states(self) -> int:
        return len(self._matchers)

    def prepare(self, rows: Sequence[SamplingRow]) -> None:
        self._pending = None
        if self._matchers and any(row.generator_key in self._matchers for row in rows):
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvserve-grammar")
            self._pending = (rows, self._worker.submit(self._fill, rows))

    def close(self) -> None:
        """Stop the mask thread (a closed engine steps no more); a later constrained step starts another."""
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None

    def apply(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        pending, self._pending = self._pending, None
        start = time.perf_counter()
        masks = pending[1].result() if pending is not None and pending[0] is rows else self._fill(rows)
        if not masks.selected:
            return
        self.stats.steps += 1
        self.stats.rows += len(masks.selected)
        self.stats.fill_seconds += masks.seconds
        self.stats.wait_seconds += time.perf_counter() - start
        apply_token_mask(logits, masks.bitmask, masks.selected, self.compiler.vocab_size)

    def _fill(self, rows: Sequence[SamplingRow]) -> _Masks:
        """The masks of the constrained rows. Runs on the worker thread while the model runs: matchers only
        change in ``accept``, ``add`` and ``drop``, which the runner calls outside that window."""
        import xgrammar

        start = time.perf_counter()
        bitmask = xgrammar.allocate_token_bitmask(len(rows), self.compiler.vocab_size)
        selected = []
        walks: dict[str, _DraftWalk] = {}
        for i, row in enumerate(rows):
            key = row.generator_key
            if key not in self._matchers:
                continue
            walk = walks.get(key)
            if walk is None:  # the request's first row: its matcher is where its outputs end
                walk = walks[key] = _DraftWalk(self._matchers[key], row, self._gates.get(key))
            elif not walk.advance_to(row):
                continue  # past a draft token the grammar refuses: masked out, so this row is never emitted
            if walk.gate is not None:
                continue  # still thinking: the row is free
            selected.append(i)
            if walk.matcher.is_terminated():  # its document ended with a stop token that ignore_eos kept going
                bitmask[i] = self._stop_only_row()
            else:
                walk.matcher.fill_next_token_bitmask(bitmask, i)
        for walk in walks.values():
            walk.rewind()
        return _Masks(bitmask, selected, time.perf_counter() - start)

    def _stop_only_row(self) -> torch.Tensor:
        """A mask row that allows only the stop tokens (bit t % 32 of word t // 32, xgrammar's layout)."""
        if self._stop_only is None:
            import numpy as np

            words = np.zeros(-(-self.compiler.vocab_size // 32), dtype=np.uint32)
            for token_id in self.compiler.stop_token_ids():
                words[token_id // 32] |= np.uint32(1 << (token_id % 32))
            self._stop_only = torch.from_numpy(words.view(np.int32))
        return self._stop_only


class _DraftWalk:
    """A matcher walked along a speculating request's draft tokens, one row (one more token) at a time, to
    mask each verified position, then rolled back. Tokens after the document's end are skipped, as
    ``GrammarProcessor.accept`` skips them; so are those up to the token the constraint waits for (``gate``,
    None once a draft holds it: the walk's own, the processor's wait is left as it was)."""

    def __init__(self, matcher: Any, first_row: SamplingRow, gate: int | None) -> None:
        self.matcher = matcher
        self.gate = gate
        self._num_outputs = len(first_row.output_token_ids)  # the outputs the matcher has accepted
        self._num_accepted = 0  # by the walk, to roll back
        self._refused = False

    def advance_to(self, row: SamplingRow) -> bool:
        """Accept the row's outputs past those already walked; False once the grammar refused one."""
        for token_id in row.output_token_ids[self._num_outputs :]:
            self._num_outputs += 1
            if self.gate is not None:
                if token_id == self.gate:
                    self.gate = None
                continue
            if self._refused or self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(int(token_id)):
                self._refused = True
                continue
            self._num_accepted += 1
        return not self._refused

    def rewind(self) -> None:
        if self._num_accepted:
            self.matcher.rollback(self._num_accepted)


def _after(token_ids: Sequence[int], token_id: int) -> int | None:
    """The index just past the first ``token_id`` in ``token_ids``, or None where it is not there."""
    for index, candidate in enumerate(token_ids):
        if candidate == token_id:
            return index + 1
    return None


def _xgrammar_message(error: RuntimeError) -> str:
    """xgrammar's error without the log prefix it carries ("[23:05:48] /project/cpp/regex_converter.cc:94: "): a
    time and a C++ source path are no help to a client."""
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", str(error)).strip()
