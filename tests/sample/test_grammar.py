"""Structured output through the engine on a seeded tiny checkpoint: every output under a JSON schema (a suite
of 32) parses and validates, regex / choice / grammar outputs match, free requests beside constrained ones get
exactly their own tokens, constrained requests survive preemption, chunked prefill, stop strings and prefix
hits, masks are filled on the worker thread, and no matcher outlives its request."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import jsonschema
import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.sample import grammar
from kvserve.sample.grammar import MAX_CONSTRAINT_CHARS, StructuredOutputCompiler
from tests.engine.byte_bpe import byte_bpe_tokenizer

OBJ = "object"
SCHEMAS = [
    {"type": "integer"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "maxLength": 8},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"const": "fixed"},
    {"type": "string", "pattern": "^[a-c]{3}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "email"},  # xgrammar ignores maxLength beside a format
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}], "items": False},
    {"type": OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}}, "required": ["a"]},
    {"type": OBJ, "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}, "required": ["a", "b"]},
    {"type": OBJ, "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                                        "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": OBJ, "properties": {"inner": {"type": OBJ, "properties": {"x": {"type": "number"}}, "required": ["x"]}},
     "required": ["inner"]},
    {"type": OBJ, "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                          "maxItems": 3}}, "required": ["tags"]},
    {"type": OBJ, "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}},
     "required": ["v"]},
    {"type": OBJ, "properties": {"v": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["v"]},
    {"oneOf": [{"type": ["string", "null"], "maxLength": 3}, {"type": "integer"}]},  # a 500 once (a type list)
    {"type": OBJ, "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["kind", "n"]},
    {"type": OBJ, "properties": {"opt": {"type": "integer"}}},
    {"type": OBJ, "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
     "$defs": {"point": {"type": OBJ, "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"]}}},
    {"type": OBJ, "properties": {"list": {"type": "array", "items": {"type": OBJ, "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["id"]}, "minItems": 1, "maxItems": 2}},
     "required": ["list"]},
    {"type": OBJ, "properties": {"count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
     "required": ["count"]},
    {"type": OBJ, "properties": {"flag": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["flag", "note"]},
    {"type": OBJ, "properties": {"a": {"type": OBJ, "properties": {"b": {"type": OBJ, "properties": {
        "c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": OBJ, "properties": {"when": {"type": "string", "format": "date-time"}}, "required": ["when"]},
    {"type": OBJ, "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
]


FORMAT_SHAPES = {"date": r"\d{4}-\d{2}-\d{2}", "email": r"[^@\s]+@[^@\s]+"}


@pytest.fixture(scope="module")
def llm(tiny_checkpoints) -> LLM:
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=256)


def constrained(max_tokens: int = 160, temperature: float = 0.0, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=3,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_every_schema_output_parses_and_validates(llm: LLM) -> None:
    assert len(SCHEMAS) >= 30
    params = [constrained(json=schema, temperature=t) for schema in SCHEMAS for t in (0.0, 1.0)]
    outs = llm.generate(["a prompt"] * len(params), params)
    finished = 0
    for out, p in zip(outs, params):
        completion = out.outputs[0]
        if completion.finish_reason.value != "stop":
            continue  # cut by max_tokens: a prefix of a valid document, as other engines return it
        finished += 1
        document = json.loads(completion.text)  # strict: no raw control character in a string either
        jsonschema.validate(document, p.structured_outputs.json)
        for name, shape in FORMAT_SHAPES.items():  # formats are enforced by shape (xgrammar's own regexes), so
            if p.structured_outputs.json.get("format") == name:  # "2025-06-31" is a date to it
                assert re.fullmatch(shape, document), (name, document)
    assert finished >= 0.9 * len(params)


def test_a_length_bounded_string_is_written_as_json_writes_strings(llm: LLM) -> None:
    """xgrammar writes its characters as [^"\\\r\n] (mlc-ai/xgrammar#800): a raw control character passed, so the
    document was no JSON (a random model wrote 2 in 8 so), and no escape could be written."""
    import xgrammar

    compiler = StructuredOutputCompiler(llm.engine.tokenizer, llm.engine.tokenizer.vocab_size,
                                        sorted(llm.engine.eos_token_ids))
    schema = {"type": OBJ, "properties": {"k": {"type": "string", "minLength": 1, "maxLength": 3}}, "required": ["k"]}

    def admits(document: str) -> bool:
        matcher = xgrammar.GrammarMatcher(compiler.compile(StructuredOutputsParams(json=schema)))
        return matcher.accept_string(document) and matcher.is_completed()

    for text in ["a", "abc", 'a"b', "a\\", "\n\t", "é\u2028x"]:  # an escape counts one character
        assert admits(json.dumps({"k": text})), text
        assert admits(json.dumps({"k": text}, ensure_ascii=False)), text
    for document in ['{"k": "a\x0e"}', '{"k": "a\tb"}', '{"k": ""}', '{"k": "abcd"}', '{"k": "a\\"bcd"}']:
        assert not admits(document), document
    outs = llm.generate(["a prompt"], SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=16,
                                                    structured_outputs=StructuredOutputsParams(json=schema)))
    for sample in outs[0].outputs:
        if sample.finish_reason.value == "stop":
            jsonschema.validate(json.loads(sample.text), schema)


def test_regex_choice_and_grammar_outputs_match(llm: LLM) -> None:
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    params = [constrained(regex=r"[a-z]{3}-\d{2}"), constrained(choice=["yes", "no", "maybe so"]),
              constrained(grammar=grammar, temperature=1.0), constrained(json_object=True, max_tokens=200)]
    regex_out, choice_out, grammar_out, object_out = (o.outputs[0] for o in llm.generate(["q"] * 4, params))
    assert re.fullmatch(r"[a-z]{3}-\d{2}", regex_out.text)
    assert choice_out.text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\(\d(\+\d)*\)", grammar_out.text)
    if object_out.finish_reason.value == "stop":
        assert isinstance(json.loads(object_out.text), dict)


def test_a_choice_past_the_basic_plane_is_spelled_as_its_own_bytes(llm: LLM) -> None:
    """An emoji written as two surrogate escapes made xgrammar force each surrogate's bytes: invalid UTF-8."""
    choices = ["wave \U0001F30A", "\u65e5\u672c \U0001F600 sand"]
    outs = llm.generate(["q", "r", "s", "t"], constrained(choice=choices, temperature=1.0))
    assert all(o.outputs[0].text in choices for o in outs), [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constraint_that_ends_before_min_tokens_ends_the_output(llm: LLM, temperature: float) -> None:
    """After "ab" the grammar allows only EOS, which min_tokens banned: a row of -inf drew token 0, so the
    output went on past the constraint ("ab<|pad|><|pad|>") and still said it stopped."""
    params = SamplingParams(max_tokens=16, min_tokens=6, temperature=temperature, seed=3, skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(choice=["ab"]))
    (out,) = llm.generate(["q"], params)[0].outputs
    assert out.text == "ab" and out.finish_reason.value == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids


def test_free_requests_beside_constrained_ones_get_their_own_tokens(llm: LLM) -> None:
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(["the free one"], free)[0].outputs[0].token_ids
    mixed = llm.generate(["the free one", "a constrained one", "another"],
                         [free, constrained(json=SCHEMAS[18]), constrained(regex="[0-9]{4}")])
    assert mixed[0].outputs[0].token_ids == alone


def test_samples_of_one_request_each_follow_the_constraint_and_leave_no_state(llm: LLM) -> None:
    params = SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=7,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"]))
    (out,) = llm.generate(["pick"], params)
    assert len(out.outputs) == 4 and all(c.text in ("alpha", "beta", "gamma") for c in out.outputs)
    assert llm.engine.core.runner.sampler.num_states == 0


def test_an_aborted_constrained_request_leaves_no_matcher(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("abort-me", {"prompt_token_ids": [5, 6, 7]}, constrained(json=SCHEMAS[20], max_tokens=64))
    for _ in range(3):
        engine.step()
    engine.abort_request(["abort-me"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core.runner.sampler.num_states == 0


@pytest.mark.parametrize("constraint, fragment", [
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "JSON schema does not compile"),
    ({"regex": "(unclosed"}, "regex does not compile"),
    ({"grammar": "root ::= undefined_rule"}, "grammar does not compile"),
    ({"choice": ["a\ud800"]}, "choice is not valid UTF-8: it holds a lone surrogate"),
    ({"json": {"enum": ["a\ud800"]}}, "JSON schema is not valid UTF-8: it holds a lone surrogate"),
    ({"regex": "a\ud800"}, "regex is not valid UTF-8: it holds a lone surrogate"),
])
def test_a_constraint_that_does_not_compile_is_refused_by_name(llm: LLM, constraint: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as refused:
        llm.generate(["x"], constrained(**constraint))
    assert ".cc:" not in str(refused.value) and not re.search(r"\[[0-9:]+\]", str(refused.value))  # xgrammar's log


def test_a_schema_nested_past_what_can_be_checked_is_refused_by_name(llm: LLM) -> None:
    """A RecursionError from the checks (offline: a server's body parser refuses such nesting first)."""
    schema: dict = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ValueError, match="structured output: the JSON schema is nested too deeply to check"):
        llm.generate(["x"], constrained(json=schema))
    assert llm.stats()["num_waiting"] == 0


LONG = "x" * (MAX_CONSTRAINT_CHARS + 1)


@pytest.mark.parametrize("constraint, kind", [
    ({"json": {"type": "string", "enum": [LONG]}}, "JSON schema"),
    ({"regex": LONG}, "regex"),
    ({"choice": ["a", LONG]}, "choice"),
    ({"grammar": f'root ::= "{LONG}"'}, "grammar"),
])
def test_a_constraint_past_the_size_limit_is_refused_before_it_compiles(llm: LLM, constraint: dict, kind: str) -> None:
    """xgrammar's time and memory grow faster than a constraint's size (a 1 MB choice took minutes, 1.6 MB of
    rules passed 7 GB): one request must not be able to take the server down by it."""
    with pytest.raises(ValueError, match=f"the {kind} is [0-9,]+ characters long; at most 65,536 are compiled"):
        llm.generate(["x"], constrained(**constraint))
    assert llm.stats()["num_waiting"] == 0


def test_the_size_limit_counts_characters_not_escapes() -> None:
    """Non-ASCII text counted as its six-character escapes: an 11,000-character CJK choice was "66,002 long"."""
    cjk = "\u4e2d" * 20_000
    for spec in (StructuredOutputsParams(choice=[cjk]), StructuredOutputsParams(json={"enum": [cjk]})):
        kind, text = StructuredOutputCompiler._key(spec)
        assert cjk in text and len(text) < 20_000 + 32, (kind, len(text))


def test_one_constraint_at_a_time() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "integer"}, regex="a")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])


def test_constrained_requests_survive_preemption_and_chunked_prefill(tiny_checkpoints) -> None:
    """A pool too small for the batch preempts (by recompute) in the middle of constrained outputs, and long
    prompts go in chunks: every output still matches, equals its run alone, and no matcher is left."""
    small = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=24, block_size=4,
                max_num_batched_tokens=16)
    prompts = [f"request {i} " * 6 for i in range(6)]
    params = constrained(regex="[a-f]{6}-[0-9]{20}", max_tokens=40)
    outs = small.generate(prompts, params)
    assert small.stats()["num_preemptions"] > 0
    assert all(re.fullmatch("[a-f]{6}-[0-9]{20}", o.outputs[0].text) for o in outs)
    assert [o.outputs[0].text for o in outs] == [small.generate([p], params)[0].outputs[0].text for p in prompts]
    assert small.engine.core.runner.sampler.num_states == 0


def test_stop_strings_logprobs_and_prefix_hits_under_a_constraint(llm: LLM) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, logprobs=2, stop=["-"],
                            structured_outputs=StructuredOutputsParams(regex="[a-c]{4}-[0-9]{4}"))
    prompt = "a shared prefix that spans several blocks of the cache, " * 2
    first, second = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    assert re.fullmatch("[a-c]{4}", first.outputs[0].text)  # cut at the stop string
    assert second.num_cached_tokens > 0 and second.outputs[0].text == first.outputs[0].text
    assert len(first.outputs[0].logprobs) == len(first.outputs[0].token_ids)


def test_masks_are_filled_on_the_worker_thread_while_the_model_runs(llm: LLM) -> None:
    grammar = llm.engine.core.runner.grammar
    before = grammar.stats.steps
    threads: set[str] = set()
    fill = grammar._fill

    def recording_fill(rows):
        threads.add(threading.current_thread().name)
        return fill(rows)

    grammar._fill = recording_fill
    try:
        llm.generate(["x", "y"], [constrained(regex="[0-9]{8}"), SamplingParams(max_tokens=8, temperature=0)])
    finally:
        del grammar._fill
    assert grammar.stats.steps - before >= 8
    assert threads and all(name.startswith("kvserve-grammar") for name in threads)
    assert llm.stats()["grammar_mask_rows"] >= llm.stats()["grammar_mask_steps"] > 0


def test_the_real_smollm2_follows_every_schema() -> None:
    """The default model, asked in its chat format, under each schema: every output that ends by itself
    parses and validates, and at least 90% end by themselves within the budget."""
    llm = LLM("smollm2-135m-instruct", max_model_len=1024, num_kv_blocks=512)
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with a short JSON document."}],
                                           tokenize=False, add_generation_prompt=True)
    params = [constrained(json=schema, max_tokens=96) for schema in SCHEMAS]
    outs = llm.generate([prompt] * len(params), params)
    finished = [(o.outputs[0].text, p) for o, p in zip(outs, params) if o.outputs[0].finish_reason.value == "stop"]
    assert len(finished) >= 0.9 * len(params)
    for text, p in finished:
        jsonschema.validate(json.loads(text), p.structured_outputs.json)


def test_ignore_eos_after_a_finished_document_allows_only_stop_tokens(llm: LLM) -> None:
    """A complete document ends with EOS; with ignore_eos the request goes on, and every later token is a stop
    token (the matcher has terminated) instead of a failed step."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (out,) = llm.generate(["answer:"], params)
    eos = llm.get_tokenizer().eos_token_id
    text_ids = out.outputs[0].token_ids
    assert len(text_ids) == 24
    first_eos = text_ids.index(eos)
    assert llm.get_tokenizer().decode(text_ids[:first_eos]) in ("yes", "no")
    assert set(text_ids[first_eos:]) == {eos}
    assert llm.engine.core.runner.sampler.num_states == 0


def test_a_speculating_request_is_masked_at_each_draft_position_and_its_matcher_rolled_back(llm: LLM) -> None:
    """Row j's mask is the matcher's after the first j draft tokens; a row past a draft token the grammar
    refuses is left unmasked (it is never emitted); afterwards the matcher is where it was."""
    import torch
    import xgrammar

    from kvserve.sample.grammar import GrammarProcessor, StructuredOutputCompiler
    from kvserve.sample.metadata import SamplingBatch, SamplingRow

    tokenizer = llm.get_tokenizer()
    compiler = StructuredOutputCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    processor = GrammarProcessor(compiler)
    params = constrained(regex="[0-9]{2}[a-z]+")
    one, two, letter = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("1", "2", "a"))
    base = SamplingRow(params, 0, "r", [5], [one])
    processor.add("r", base)

    def allowed(rows: list[SamplingRow]) -> torch.Tensor:
        logits = torch.zeros(len(rows), compiler.vocab_size)
        processor.prepare(rows)
        processor.apply(logits, rows)
        return logits > -torch.inf

    got = allowed(SamplingBatch.of_requests([base], [(two, letter, two)]).rows)
    reference = xgrammar.GrammarMatcher(compiler.compile(params.structured_outputs))
    bitmask = xgrammar.allocate_token_bitmask(4, compiler.vocab_size)  # all ones
    for j, token_id in enumerate([one, two, letter]):  # then "2" after "12a" is refused: row 3 stays all ones
        assert reference.accept_token(token_id)
        reference.fill_next_token_bitmask(bitmask, j)
    bits = torch.arange(compiler.vocab_size)
    expected = (bitmask[:, bits // 32] >> (bits % 32)) & 1 == 1
    assert torch.equal(got, expected)
    assert got[0, two] and not got[0, letter] and got[1, letter] and not got[1, two]  # digits, then letters
    assert torch.equal(allowed([base]), expected[:1])  # the walk was rolled back


def _field_schemas(count: int) -> list[StructuredOutputsParams]:
    return [StructuredOutputsParams(json={"type": "object", "properties": {f"field_{i}": {"type": "string"}},
                                          "required": [f"field_{i}"]}) for i in range(count)]


def test_the_compiled_grammar_cache_is_bounded(monkeypatch) -> None:
    """Unbounded, a server whose clients each send their own schema grew by every schema it ever compiled (and
    xgrammar's own cache, bounded, still grew it: ours drops the grammars it evicts, which frees them)."""
    monkeypatch.setattr(grammar, "GRAMMAR_CACHE_BYTES", 64 * 2**10)
    compiler = StructuredOutputCompiler(byte_bpe_tokenizer(), 300, [1])
    specs = _field_schemas(40)
    latest = [compiler.compile(spec) for spec in specs][-1]  # the others dropped, as by requests that ended
    assert 0 < compiler.cache_bytes <= 64 * 2**10 and len(compiler._cache) < 40
    assert compiler.compile(specs[-1]) is latest  # the latest kept
    assert not compiler.is_cached(specs[0])  # the first evicted and freed: compiled again if asked for


def test_a_grammar_a_request_still_holds_is_found_after_its_eviction(monkeypatch) -> None:
    """A queue of more distinct schemas than the cache holds evicted a waiting request's grammar, which the runner
    then compiled again on the engine thread, stalling every stream, when the request was scheduled."""
    monkeypatch.setattr(grammar, "GRAMMAR_CACHE_BYTES", 64 * 2**10)
    compiler = StructuredOutputCompiler(byte_bpe_tokenizer(), 300, [1])
    specs = _field_schemas(40)
    held = compiler.compile(specs[0])
    for spec in specs[1:]:
        compiler.compile(spec)
    assert ("json", json.dumps(specs[0].json, separators=(",", ":"))) not in compiler._cache  # evicted
    assert compiler.is_cached(specs[0]) and compiler.compile(specs[0]) is held
    assert next(reversed(compiler._cache.values())) is held  # back in the cache, as its most recent


def test_an_engine_compiles_each_queued_constraint_once_whatever_the_cache_keeps(llm: LLM, monkeypatch) -> None:
    monkeypatch.setattr(grammar, "GRAMMAR_CACHE_BYTES", 1)  # the cache keeps only its latest grammar
    compiled = []
    monkeypatch.setattr(grammar, "_json_schema_grammar", lambda text, compile=grammar._json_schema_grammar: (
        compiled.append(text) or compile(text)))
    specs = _field_schemas(6)
    params = [SamplingParams(max_tokens=8, structured_outputs=spec) for spec in specs]
    outputs = llm.generate(["q"] * len(specs), params)
    assert len(compiled) == len(specs) == len(set(compiled))  # at admission only, none again when scheduled
    for output, spec in zip(outputs, specs):
        assert output.outputs[0].text.startswith('{"field_')


def test_a_constraint_that_begins_after_a_token_leaves_the_output_free_until_it(llm: LLM) -> None:
    """Greedy without a constraint writes some token ``gate`` at position k: with a choice that begins after
    ``gate``, the first k + 1 tokens are the free ones and the rest is the choice (each of an n = 2 request's
    samples too)."""
    prompt = "a prompt whose free answer goes on for a while"
    free = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    k = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])
    gate = free.token_ids[k]
    params = constrained(choice=["yes", "no way"], begins_after_token_id=gate)
    outs = llm.generate([prompt] * 2, [params, dataclasses.replace(params, n=2)])
    for completion in (*outs[0].outputs, *outs[1].outputs):
        assert completion.token_ids[:k + 1] == free.token_ids[:k + 1]
        answer = llm.get_tokenizer().decode(completion.token_ids[k + 1:], skip_special_tokens=True)
        assert answer in ("yes", "no way") and completion.finish_reason.value == "stop"
    assert llm.engine.core.runner.sampler.num_states == 0
    # a gate never sampled leaves the whole output free
    unseen = next(t for t in range(100) if t not in free.token_ids)
    never = constrained(choice=["yes"], begins_after_token_id=unseen, max_tokens=12)
    assert llm.generate(prompt, dataclasses.replace(never, ignore_eos=True))[0].outputs[0].token_ids == free.token_ids


def test_a_gated_matcher_starts_after_the_gate_in_resumed_outputs_and_in_drafts(llm: LLM) -> None:
    """A resumed request whose outputs hold the gate starts its matcher after it; a speculating row walks its
    drafts free up to the gate and masked after it, and the processor's wait is left as it was."""
    import torch

    from kvserve.sample.grammar import GrammarProcessor, StructuredOutputCompiler
    from kvserve.sample.metadata import SamplingBatch, SamplingRow

    tokenizer = llm.get_tokenizer()
    compiler = StructuredOutputCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    processor = GrammarProcessor(compiler)
    one, letter, gate = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("1", "a", "|"))
    params = constrained(regex="[0-9]+", begins_after_token_id=gate)

    def allowed(rows: list[SamplingRow]) -> torch.Tensor:
        logits = torch.zeros(len(rows), compiler.vocab_size)
        processor.prepare(rows)
        processor.apply(logits, rows)
        return logits > -torch.inf

    waiting = SamplingRow(params, 0, "w", [5], [letter])
    processor.add("w", waiting)
    assert allowed([waiting]).all()  # free until the gate
    got = allowed(SamplingBatch.of_requests([waiting], [(letter, gate, one)]).rows)
    assert got[0].all() and got[1].all()  # a letter, then the gate: both free
    assert got[2, one] and not got[2, letter] and got[3, one] and not got[3, letter]  # digits after it
    assert allowed([waiting]).all()  # the drafts were not the request's: it still waits
    processor.accept("w", [letter, gate, one])
    assert allowed([waiting]).sum() < compiler.vocab_size
    resumed = SamplingRow(params, 0, "r", [5], [letter, gate, one])
    processor.add("r", resumed)
    mask = allowed([resumed])[0]
    assert mask[one] and not mask[letter]
    processor.drop("w")
    processor.drop("r")
    assert processor.num_states == 0


def test_a_gated_constraint_under_speculation_and_preemption_gives_the_plain_runs_tokens(llm: LLM,
                                                                                         tiny_checkpoints) -> None:
    """n-gram drafts (walked free up to the gate and masked past it) and a pool small enough to preempt: the same
    tokens as the plain engine's, the choice after the gate."""
    prompts = ["one two three one two three one two three"] * 4
    free = llm.generate(prompts[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    gate = next(t for i, t in enumerate(free.token_ids) if i >= 4 and t not in free.token_ids[:i])
    params = [constrained(choice=["yes", "no way"], begins_after_token_id=gate, max_tokens=40)] * 4
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    busy = LLM(str(tiny_checkpoints["llama"]), dtype="float32", num_kv_blocks=12, block_size=4,
               max_num_batched_tokens=16, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    outs = busy.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(gate in tokens for tokens in expected)
    stats = busy.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_draft_tokens"] > 0
    assert busy.engine.core.runner.sampler.num_states == 0
    busy.close()
