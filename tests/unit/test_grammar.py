"""homepd.llm.grammar: every grammar it builds parses in llama.cpp (on SmolLM2's vocabulary) and holds the
model to what the schema or the tool format says; a schema it cannot enforce is refused, naming the path and
the keyword, before anything is converted."""
from __future__ import annotations

import itertools
import json
import re
import time
from enum import Enum
from typing import Annotated, Literal, Optional, Union

import pytest

from homepd.chat.format import ChatFormat, ThinkMarkers, ToolChoice, ToolChoiceMode, ToolFormat, ToolSpec
from homepd.chat.parser import ReplyParser
from homepd.errors import RequestError
from homepd.llm import LlamaModel
from llama_oracle import accepts, compiles
from homepd.structured.limits import MAX_SCHEMA_PROPERTIES
from homepd.llm.grammar import (check_schema, int_range_gbnf, json_object_grammar,
                                json_schema_grammar, tool_grammar, trigger_patterns)

THINK = ThinkMarkers("<think>", "</think>")
FORMATS = {
    "hermes": ChatFormat(ToolFormat.HERMES, True, None, False),
    "qwen3": ChatFormat(ToolFormat.HERMES, True, THINK, False),
    "opens": ChatFormat(ToolFormat.HERMES, True, THINK, True),
    "llama3": ChatFormat(ToolFormat.LLAMA3, True, None, False),
    "mistral": ChatFormat(ToolFormat.MISTRAL, True, None, False),
    "generic": ChatFormat(ToolFormat.GENERIC, False, None, False),
    "generic-think": ChatFormat(ToolFormat.GENERIC, False, THINK, False),
}
TOOLS = ToolSpec.parse_all([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
])
AUTO, REQUIRED = ToolChoice(ToolChoiceMode.AUTO), ToolChoice(ToolChoiceMode.REQUIRED)
NAMED = ToolChoice(ToolChoiceMode.FUNCTION, "get_time")


@pytest.fixture(scope="module")
def vocab(default_model_path):
    model = LlamaModel(default_model_path, vocab_only=True)
    yield model
    model.close()


# ---- the schema check ------------------------------------------------------------------------------------

P = "response_format.json_schema.schema"
REFUSED = [
    ({"not": {"type": "string"}}, f"{P}.not"),
    ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, f"{P}.properties.a.if"),
    ({"type": "object", "patternProperties": {"^x": {}}}, f"{P}.patternProperties"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, f"{P}.propertyNames"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, f"{P}.dependentRequired"),
    ({"type": "array", "contains": {"type": "integer"}}, f"{P}.contains"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, f"{P}.uniqueItems"),
    ({"type": "number", "minimum": 1.5}, f"{P}.minimum"),
    ({"type": "number", "maximum": 10}, f"{P}.maximum"),
    ({"type": "number", "exclusiveMinimum": 0}, f"{P}.exclusiveMinimum"),
    ({"type": "number", "multipleOf": 0.5}, f"{P}.multipleOf"),
    ({"type": "integer", "multipleOf": 3}, f"{P}.multipleOf"),
    ({"type": "integer", "exclusiveMinimum": True, "minimum": 0}, f"{P}.exclusiveMinimum: the draft-4 boolean"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1}, f"{P}.minProperties"),
    ({"type": "object", "additionalProperties": True, "maxProperties": 3}, f"{P}.maxProperties"),
    ({"type": "string", "format": "email"}, f"{P}.format: format 'email' is not enforced"),
    ({"type": "integer", "format": "uint8"}, f"{P}.format"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, f"{P}.maxLength"),
    ({"type": "string", "format": "date", "minLength": 3}, f"{P}.minLength"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, f"{P}.required: 'b' is required but not"),
    ({"type": "string", "contentEncoding": "base64"}, f"{P}.contentEncoding"),
    ({"type": "string", "nullable": True}, f"{P}.nullable"),
    ({"type": "object", "unevaluatedProperties": False}, f"{P}.unevaluatedProperties"),
    ({"type": "array", "prefixItems": [{"type": "string"}], "minItems": 2}, f"{P}.minItems"),
    ({"type": "array", "maxItems": 5000}, f"{P}.maxItems: 5000 is more than 1000"),
    ({"type": "object", "propertys": {}}, f"{P}.propertys: unknown keyword 'propertys'"),
    ({"type": "strng"}, f"{P}.type: unknown type 'strng'"),
    ({"$ref": "#/$defs/S", "maxLength": 3, "$defs": {"S": {"type": "string"}}}, f"{P}.maxLength: next to $ref"),
    ({"anyOf": [{"type": "string"}, {"type": "null"}], "minLength": 2}, f"{P}.minLength: next to anyOf"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, f"{P}.oneOf: alternatives 0 and 1"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, f"{P}.oneOf: alternatives 0 and 1"),
    ({"$ref": "https://example.com/s.json"}, f"{P}.$ref: $ref 'https://example.com/s.json' points outside"),
    ({"$ref": "#/$defs/Missing"}, f"{P}.$ref: $ref '#/$defs/Missing' points at nothing"),
    ({"$ref": "#"}, "a $ref to the whole document"),
    ({"type": "string", "pattern": "^(?=a)ab$"}, f"{P}.pattern: lookaround"),
    ({"type": "string", "pattern": "\\bword\\b"}, f"{P}.pattern: word boundaries"),
    ({"type": "string", "pattern": "^(a)\\1$"}, f"{P}.pattern: back-references"),
    ({"type": "string", "pattern": "^a|^b$"}, f"{P}.pattern: an anchor inside"),
    ({"type": "string", "pattern": "^\\p{L}+$"}, f"{P}.pattern: \\p escapes"),
    ({"type": "string", "pattern": "^a{1001}$"}, f"{P}.pattern: a count over 1000"),
    ({"type": "string", "pattern": "^(ab$"}, f"{P}.pattern: an unbalanced '('"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, f"{P}: no integer lies between its bounds"),
    ({"type": "string", "minLength": 5, "maxLength": 3}, f"{P}: minLength 5 > maxLength 3"),
    ({"enum": []}, f"{P}.enum must be a non-empty list"),
    ({"enum": [1, 2], "type": "string"}, f"{P}: no value of its enum/const has its type"),
    ({"properties": {"a": {}}, "items": {}}, f"{P}: keywords of more than one type"),
    ({"$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}},
      "$ref": "#/$defs/A"}, f"{P}.$defs.A: this schema refers to itself with no way to end"),
    ({"$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}}, "$ref": "#/$defs/A"},
     f"{P}.$defs.A: this schema refers back to itself before any value starts"),
    ({"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "string"}]}, f"{P}.allOf[1]: allOf is enforced"),
    (5, f"{P} must be a JSON Schema"),
    (False, f"{P} is false"),
]


@pytest.mark.parametrize("schema,message", REFUSED, ids=[m.split(": ")[0].removeprefix(P) or m for _, m in REFUSED])
def test_a_schema_the_grammar_cannot_enforce_is_refused_naming_path_and_keyword(schema, message):
    with pytest.raises(RequestError) as err:
        check_schema(schema)
    assert message in str(err.value)
    with pytest.raises(RequestError):
        json_schema_grammar(schema)


def test_tool_parameters_are_checked_under_their_own_path():
    tools = ToolSpec.parse_all([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                                {"type": "function", "function": {"name": "g", "parameters": {"not": {}}}}])
    with pytest.raises(RequestError, match=r"^tools\[1\]\.function\.parameters\.not: "):
        tool_grammar(FORMATS["hermes"], tools, AUTO, False)


@pytest.mark.parametrize("schema", [
    {"type": "string", "title": "T", "description": "d", "examples": ["x"], "default": "x", "$comment": "c",
     "deprecated": False, "readOnly": True, "writeOnly": False, "$id": "urn:x", "x-vendor": {"anything": [1]},
     "$schema": "https://json-schema.org/draft/2020-12/schema"},
    {"type": "integer", "multipleOf": 1, "format": "int64"},
    {"type": "array", "maxItems": 1, "uniqueItems": True},
    {"type": "object", "properties": {"a": {}}, "required": ["a"], "minProperties": 1, "maxProperties": 1},
    {"type": "number", "minimum": 0},
    True, {},
], ids=["annotations", "integer-trivia", "unique-of-one", "trivial-property-counts", "number-min-0", "true", "empty"])
def test_annotations_and_constraints_the_grammar_meets_anyway_are_accepted(schema):
    check_schema(schema)


def test_a_10000_property_schema_is_refused_by_the_size_limit_at_once():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
    start = time.perf_counter()
    with pytest.raises(RequestError, match=f"more than {MAX_SCHEMA_PROPERTIES} properties in all"):
        check_schema(schema)
    assert time.perf_counter() - start < 0.05


@pytest.mark.parametrize("schema,message", [
    ({"type": "object", "properties": {"a": {"type": "string", "description": "x" * 200_000}}}, "characters"),
    (json.loads('{"items": ' * 40 + "{}" + "}" * 40), "nests more than 32 levels deep"),
    ({"enum": list(range(30_000))}, "values in all"),
])
def test_other_size_limits_refuse_before_conversion(schema, message):
    with pytest.raises(RequestError, match=message):
        check_schema(schema)


def test_the_request_repetitions_add_up_to_a_limit():
    schema = {"type": "object", "properties": {f"s{i}": {"type": "string", "maxLength": 1000} for i in range(25)}}
    with pytest.raises(RequestError, match="repetitions .* add up to more than 20000"):
        check_schema(schema)


# ---- pydantic schemas convert and hold ---------------------------------------------------------------------

def person_schema() -> dict:
    pydantic = pytest.importorskip("pydantic")
    Field = pydantic.Field

    class Color(str, Enum):
        red = "red"
        green = "green"

    class Address(pydantic.BaseModel):
        street: str
        zip: Annotated[str, Field(pattern=r"^\d{5}$")]

    class Cat(pydantic.BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(pydantic.BaseModel):
        pet_type: Literal["dog"]
        barks: float

    class Person(pydantic.BaseModel):
        name: str
        age: Annotated[int, Field(ge=0, le=150)]
        nickname: Optional[str] = None
        color: Color = Color.red
        scores: Annotated[list[Annotated[int, Field(ge=0, le=100)]], Field(max_length=5)]
        address: Address
        pet: Union[Cat, Dog] = Field(discriminator="pet_type")
        kind: Literal["a", "b"]

    return Person.model_json_schema()


# the grammar writes the required properties first, then the optional ones, each in declared order
PERSON = {"name": "Ada", "age": 36, "scores": [0, 100, 7], "address": {"street": "1 Main St", "zip": "12345"},
          "pet": {"pet_type": "cat", "meows": 3}, "kind": "b", "nickname": None, "color": "green"}


def test_a_pydantic_model_converts_and_its_instances_are_accepted(vocab):
    grammar = json_schema_grammar(person_schema())
    assert grammar.origin == "json_schema" and not grammar.is_lazy and compiles(vocab, grammar)
    assert accepts(vocab, grammar, json.dumps(PERSON))
    assert accepts(vocab, grammar, json.dumps({k: v for k, v in PERSON.items() if k not in ("nickname", "color")}))
    assert accepts(vocab, grammar, json.dumps(dict(PERSON, pet={"pet_type": "dog", "barks": 1.5}, nickname="A")))
    assert not accepts(vocab, grammar, json.dumps({"nickname": None, **PERSON}))   # the order above


@pytest.mark.parametrize("change", [
    {"age": 151}, {"age": -1}, {"age": "36"}, {"scores": [1, 2, 3, 4, 5, 6]}, {"scores": [101]},
    {"address": {"street": "x", "zip": "1234"}}, {"pet": {"pet_type": "cow", "meows": 1}},
    {"pet": {"pet_type": "dog", "meows": 1}}, {"color": "blue"}, {"kind": "c"}, {"extra": 1},
], ids=lambda c: next(iter(c)))
def test_a_pydantic_model_rejects_what_breaks_it(vocab, change):
    grammar = json_schema_grammar(person_schema())
    assert not accepts(vocab, grammar, json.dumps(dict(PERSON, **change)))
    assert not accepts(vocab, grammar, json.dumps({k: v for k, v in PERSON.items() if k != "address"}))


# ---- what the emitted grammar enforces ---------------------------------------------------------------------

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}


@pytest.mark.parametrize("extra,text,ok", [
    ({}, '{"a": 1}', True),
    ({}, '{"a": 1, "b": "x"}', True),
    ({}, '{"b": "x"}', False),                      # required is required
    ({}, '{"a": 1, "c": 2}', False),                # absent additionalProperties next to properties: none
    ({"additionalProperties": False}, '{"a": 1, "c": 2}', False),
    ({"additionalProperties": True}, '{"a": 1, "c": [2, {"d": null}]}', True),
    ({"additionalProperties": True}, '{"a": 1, "b": "x", "a": "again"}', False),   # no declared name twice
    ({"additionalProperties": True}, '{"a": 1, "ab": 2, "": 3}', True),
    ({"additionalProperties": {"type": "integer"}}, '{"a": 1, "c": 2, "d": 3}', True),
    ({"additionalProperties": {"type": "integer"}}, '{"a": 1, "c": "x"}', False),
])
def test_objects_follow_required_and_additional_properties(vocab, extra, text, ok):
    assert accepts(vocab, json_schema_grammar(dict(OBJ, **extra)), text) is ok


@pytest.mark.parametrize("schema,text,ok", [
    ({"type": "object"}, '{"any": {"thing": [1, "two", null]}}', True),
    ({"type": "string"}, '"tab\\tquote\\"unicode\\u00e9"', True),
    ({"type": "string"}, '"raw\nnewline"', False),           # a control character must be escaped in JSON
    ({"enum": ['q"x', "a\\b", "é\n"]}, json.dumps('q"x'), True),
    ({"enum": ['q"x', "a\\b", "é\n"]}, json.dumps("a\\b"), True),
    ({"enum": ['q"x', "a\\b", "é\n"]}, json.dumps("é\n", ensure_ascii=False), True),
    ({"enum": ['q"x', "a\\b", "é\n"]}, '"a\\u0008"', False),
    ({"type": "string", "pattern": "^\\d{3}-\\d{4}$"}, '"555-1234"', True),
    ({"type": "string", "pattern": "^\\d{3}-\\d{4}$"}, '"555-12345"', False),
    ({"type": "string", "pattern": '^say "\\w+"\\.$'}, json.dumps('say "hi".'), True),
    ({"type": "string", "pattern": '^say "\\w+"\\.$'}, '"say "hi"."', False),
    ({"type": "string", "pattern": "^[^,]+$"}, '"no commas"', True),
    ({"type": "string", "pattern": "^[^,]+$"}, '"a,b"', False),
    ({"type": "string", "pattern": "^[a\\n]+$"}, '"a\\na"', True),
    ({"type": "string", "pattern": "ab"}, '"xxabyy"', True),   # unanchored: ab anywhere
    ({"type": "string", "pattern": "ab"}, '"xxa"', False),
    ({"type": "string", "pattern": "^(cat|dog)s?$"}, '"dogs"', True),
    ({"type": "string", "format": "date"}, '"2024-02-29"', True),
    ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', True),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"', False),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]", False),
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, '[1, "x"]', True),
    ({"type": ["integer", "null"], "minimum": 3}, "null", True),
    ({"type": ["integer", "null"], "minimum": 3}, "2", False),
    ({"type": "number", "minimum": 0}, "-0.5", False),
    ({"type": "number", "minimum": 0}, "2.5e-3", True),
    ({"type": "integer", "format": "int32"}, "2147483648", False),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}, '{"a": 1, "b": true}', True),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}, '{"a": 1}', False),
])
def test_the_grammar_holds_to_the_schema(vocab, schema, text, ok):
    assert accepts(vocab, json_schema_grammar(schema), text) is ok


def test_refs_resolve_in_their_own_document_even_with_clashing_names(vocab):
    schema = {"$defs": {"string": {"type": "integer"}, "value": {"const": 7}},
              "type": "object", "properties": {"string": {"$ref": "#/$defs/string"}, "v": {"$ref": "#/$defs/value"},
                                               "tree": {"$ref": "#/$defs/tree"}},
              "required": ["string", "v"]}
    schema["$defs"]["tree"] = {"type": "object", "properties": {"kids": {"type": "array",
                                                                         "items": {"$ref": "#/$defs/tree"}}}}
    grammar = json_schema_grammar(schema)
    assert accepts(vocab, grammar, '{"string": 5, "v": 7, "tree": {"kids": [{"kids": []}, {}]}}')
    assert not accepts(vocab, grammar, '{"string": "5", "v": 7}')


def test_json_object_is_any_object(vocab):
    grammar = json_object_grammar()
    assert grammar.origin == "json_object" and compiles(vocab, grammar)
    assert accepts(vocab, grammar, '{"a": [1, {"b": "c"}], "d": null}')
    assert not accepts(vocab, grammar, "[1]") and not accepts(vocab, grammar, '"x"')


def test_a_thinking_format_lets_reasoning_come_first(vocab):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    qwen3, opens = FORMATS["qwen3"], FORMATS["opens"]
    reasoning = "<think>\nn is <b>3</b>, not </thin\n</think>\n\n"
    assert accepts(vocab, json_schema_grammar(schema, qwen3), reasoning + '{"n": 3}')
    assert accepts(vocab, json_schema_grammar(schema, qwen3), '{"n": 3}')
    assert accepts(vocab, json_object_grammar(opens), 'so it is</think>\n{"n": 3}')
    assert not accepts(vocab, json_object_grammar(opens), '{"n": 3}')
    assert not accepts(vocab, json_schema_grammar(schema, qwen3), "<think>x</think> prose")


# ---- integer bounds --------------------------------------------------------------------------------------

def as_regex(gbnf_fragment: str) -> re.Pattern:
    """``int_range_gbnf``'s output (digit classes, literals, counts, groups) as the regex it spells."""
    return re.compile(gbnf_fragment.replace('"', "").replace(" ", ""))


BOUNDS = [None, -1000, -105, -100, -17, -10, -9, -1, 0, 1, 5, 9, 10, 99, 100, 105, 250, 999, 1000, 1024, 2048]


def test_integer_bounds_admit_exactly_the_integers_in_range():
    texts = [str(v) for v in range(-2100, 2101)] + ["-0", "007", "-", "0-", "00"]
    # each text with its value when it is a JSON integer, else None (parsed once, not once per pair of bounds)
    values = [(t, int(t) if re.fullmatch(r"-?(0|[1-9][0-9]*)", t) else None) for t in texts]
    for lo, hi in itertools.product(BOUNDS, BOUNDS):
        if (lo is None and hi is None) or (lo is not None and hi is not None and lo > hi):
            continue
        rx = as_regex(int_range_gbnf(lo, hi))
        for text, value in values:
            expected = value is not None and (lo is None or value >= lo) and (hi is None or value <= hi)
            if text == "-0" and expected:
                continue   # JSON's -0 is 0: admitting it or not are both right
            assert bool(rx.fullmatch(text)) is expected, (lo, hi, text)


@pytest.mark.parametrize("lo,hi", [(10 ** 14 + 3, None), (None, -(10 ** 14) - 3), (123456789012345, 10 ** 15 + 7),
                                   (-(10 ** 15), 5), (None, 10 ** 20), (-(10 ** 20), None)])
def test_large_integer_bounds_hold_at_their_edges(lo, hi):
    rx = as_regex(int_range_gbnf(lo, hi))
    for edge in [b for b in (lo, hi) if b is not None and abs(b) < 10 ** 16]:
        assert rx.fullmatch(str(edge))
    if lo is not None and abs(lo) < 10 ** 16:
        assert not rx.fullmatch(str(lo - 1))
    if hi is not None and abs(hi) < 10 ** 16:
        assert not rx.fullmatch(str(hi + 1))
    assert not rx.fullmatch("1" * 17)   # never more than 16 digits


def test_integer_bounds_hold_in_llama_cpp_where_its_own_converter_is_wrong(vocab):
    # llama.cpp's C++ build_min_max_int admits 10..15 for minimum 100 and 15..19 for minimum 105
    grammar = json_schema_grammar({"type": "integer", "minimum": 105})
    assert [v for v in (10, 15, 19, 100, 104, 105, 106, 999, 1000, 99999) if accepts(vocab, grammar, str(v))] == \
        [105, 106, 999, 1000, 99999]
    grammar = json_schema_grammar({"type": "integer", "exclusiveMaximum": -99.5, "minimum": -1e3})
    assert [v for v in (-1001, -1000, -100, -99, -19, 0) if accepts(vocab, grammar, str(v))] == [-1000, -100]


# ---- tool grammars ---------------------------------------------------------------------------------------

WEATHER_ARGS = '{"city": "Paris", "days": 3}'
CALLS = {
    ToolFormat.HERMES: f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>',
    ToolFormat.LLAMA3: f'{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}',
    ToolFormat.MISTRAL: f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}]',
    ToolFormat.GENERIC: f'{{"tool_calls": [{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}]}}',
}


@pytest.mark.parametrize("fmt_name", list(FORMATS))
@pytest.mark.parametrize("choice", [AUTO, REQUIRED, NAMED], ids=["auto", "required", "named"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_every_tool_grammar_parses_in_llama_cpp(vocab, fmt_name, choice, parallel):
    fmt = FORMATS[fmt_name]
    grammar = tool_grammar(fmt, TOOLS, choice, parallel)
    assert grammar.origin == "tools" and compiles(vocab, grammar)
    lazy = choice.mode is ToolChoiceMode.AUTO and fmt.tools is not ToolFormat.GENERIC
    assert grammar.is_lazy is lazy
    assert tool_grammar(fmt, TOOLS, ToolChoice(ToolChoiceMode.NONE), parallel) is None


@pytest.mark.parametrize("fmt_name", ["hermes", "llama3", "mistral", "generic"])
def test_a_forced_call_is_accepted_and_parses_back(vocab, fmt_name):
    fmt = FORMATS[fmt_name]
    grammar = tool_grammar(fmt, TOOLS, REQUIRED, False)
    text = CALLS[fmt.tools]
    assert accepts(vocab, grammar, text)
    assert not accepts(vocab, grammar, "Sure, let me check.")
    assert not accepts(vocab, grammar, text.replace("Paris", "Paris\", \"extra\": \"1"))   # the schema holds
    assert not accepts(vocab, grammar, text.replace('"days": 3', '"days": 8'))
    assert not accepts(vocab, grammar, text.replace("get_weather", "rm_rf"))
    envelope = fmt.tools is ToolFormat.GENERIC
    reply = ReplyParser(fmt, True, envelope, tool_names=("get_weather", "get_time"))
    reply.feed(text.replace("[TOOL_CALLS] ", ""))   # a detokenizer that drops control tokens: the bare form
    calls = reply.finish().tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]


def test_a_named_function_and_parallel_false_restrict_the_calls(vocab):
    fmt = FORMATS["hermes"]
    two = CALLS[ToolFormat.HERMES] + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert not accepts(vocab, tool_grammar(fmt, TOOLS, NAMED, True), CALLS[ToolFormat.HERMES])
    assert accepts(vocab, tool_grammar(fmt, TOOLS, REQUIRED, True), two)
    assert not accepts(vocab, tool_grammar(fmt, TOOLS, REQUIRED, False), two)
    mistral = tool_grammar(FORMATS["mistral"], TOOLS, REQUIRED, True)
    assert accepts(vocab, mistral, '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, '
                                   '{"name": "get_weather", "arguments": {"city": "Oslo"}}]')


def test_the_generic_envelope_allows_a_response_only_under_auto(vocab):
    fmt = FORMATS["generic"]
    response = '{"response": "It is \\"sunny\\"."}'
    assert accepts(vocab, tool_grammar(fmt, TOOLS, AUTO, True), response)
    assert accepts(vocab, tool_grammar(fmt, TOOLS, AUTO, True), CALLS[ToolFormat.GENERIC])
    assert not accepts(vocab, tool_grammar(fmt, TOOLS, REQUIRED, True), response)
    assert not accepts(vocab, tool_grammar(fmt, TOOLS, AUTO, True), "It is sunny.")
    think = tool_grammar(FORMATS["generic-think"], TOOLS, REQUIRED, False)
    assert accepts(vocab, think, "<think>\nweather, so a tool\n</think>\n" + CALLS[ToolFormat.GENERIC])


def test_a_forced_call_may_follow_reasoning(vocab):
    call = CALLS[ToolFormat.HERMES]
    assert accepts(vocab, tool_grammar(FORMATS["qwen3"], TOOLS, REQUIRED, False), f"<think>\nhmm\n</think>\n\n{call}")
    assert accepts(vocab, tool_grammar(FORMATS["qwen3"], TOOLS, REQUIRED, False), call)
    assert accepts(vocab, tool_grammar(FORMATS["opens"], TOOLS, REQUIRED, False), f"hmm, weather\n</think>\n{call}")
    assert not accepts(vocab, tool_grammar(FORMATS["opens"], TOOLS, REQUIRED, False), call)


@pytest.mark.parametrize("fmt_name,text,start", [
    ("hermes", f"Let me look.\n{CALLS[ToolFormat.HERMES]}", "<tool_call>"),
    ("qwen3", f"<think>\nI'd write <tool_call> next\n</think>\n\nOK.\n{CALLS[ToolFormat.HERMES]}", "<tool_call>"),
    ("qwen3", f"OK.\n{CALLS[ToolFormat.HERMES]}", "<tool_call>"),
    ("opens", f"I'd write <tool_call> next\n</think>\n\n{CALLS[ToolFormat.HERMES]}", "<tool_call>"),
    ("llama3", f"  {CALLS[ToolFormat.LLAMA3]}", '{"name"'),
    ("llama3", f'<|python_tag|>{CALLS[ToolFormat.LLAMA3]}', "<|python_tag|>"),
    ("mistral", f"Sure. {CALLS[ToolFormat.MISTRAL]}", "[TOOL_CALLS]"),
])
def test_lazy_triggers_fire_at_the_call_and_not_in_reasoning(vocab, fmt_name, text, start):
    fmt = FORMATS[fmt_name]
    grammar = tool_grammar(fmt, TOOLS, AUTO, True)
    assert grammar.trigger_patterns == trigger_patterns(fmt)
    # what llama.cpp does with the patterns (std::regex ECMAScript ~ Python re for these), on every prefix
    fired = None
    for end in range(1, len(text) + 1):
        for pattern in grammar.trigger_patterns:
            match = re.search(pattern, text[:end])
            if match:
                fired = next((match.start(g) for g in range(1, (match.lastindex or 0) + 1) if match.group(g)),
                             match.start())
                break
        if fired is not None:
            break
    assert fired == text.rindex(start)
    assert accepts(vocab, grammar, text)
    assert accepts(vocab, grammar, "No tools needed: 42.")
    assert not accepts(vocab, grammar, text[:fired] + start + ' {"name": "nope"')


def test_no_trigger_fires_inside_reasoning():
    for name in ("qwen3", "opens"):
        reasoning = "maybe <tool_call>{\"name\": \"get_time\"} would do"
        if name == "qwen3":
            reasoning = "<think>\n" + reasoning
        assert not any(re.search(p, reasoning) for p in trigger_patterns(FORMATS[name]))


@pytest.mark.parametrize("template", [None, "hermes"])
def test_tools_beside_a_response_schema_answer_in_that_schema(vocab, template):
    """With auto, a reply that is not a call is the structured answer: the envelope's response (generic) or,
    in a format with call markers, the reply itself from the first token (no lazy trigger)."""
    from homepd.chat.format import detect
    fmt = detect(None) if template is None else ChatFormat(ToolFormat.HERMES, True, None, False)
    tools = ToolSpec.parse_all([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}])
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    g = tool_grammar(fmt, tools, ToolChoice.parse("auto", tools), False, schema)
    assert not g.is_lazy
    answer = '{"response": {"answer": "hi"}}' if template is None else '{"answer": "hi"}'
    call = '{"tool_calls": [{"name": "f", "arguments": {"x": 1}}]}' if template is None else \
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert accepts(vocab, g, answer) and accepts(vocab, g, call)
    assert not accepts(vocab, g, answer.replace('"answer"', '"other"'))
