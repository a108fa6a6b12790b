"""homepd's own grammar code judged by llama.cpp's grammar engine, not by more homepd code.

* Every grammar homepd writes (each structured-output schema the suite sends, with and without a reasoning block;
  each tool format and tool choice, one call or several, with and without a response schema) compiles in
  llama.cpp, and llama.cpp lets the model write ``shortest(grammar)`` under it and then end: the string the fake
  backend answers with is one the real engine could have written.
* For a corpus of grammars, bad and good, ``homepd.structured.gbnf.parse`` refuses exactly what
  ``llama_sampler_init_grammar`` refuses (no vocabulary, as ``homepd.llm.grammar`` checks a request's grammar).
"""
from __future__ import annotations

import re

import llama_cpp as C
import pytest

from homepd.chat.format import ChatFormat, ThinkMarkers, ToolChoice, ToolChoiceMode, ToolFormat, ToolSpec
from homepd.llm import LlamaModel, _init_backend
from homepd.llm.grammar import json_object_grammar, json_schema_grammar, tool_grammar
from homepd.structured.gbnf import GbnfError, parse, shortest
from llama_oracle import accepts, compiles
from structured_schemas import MORE_SCHEMAS as SCHEMAS

THINK = ThinkMarkers("<think>", "</think>")
FORMATS = {
    "plain": None,
    "hermes": ChatFormat(ToolFormat.HERMES, True, None, False),
    "qwen3": ChatFormat(ToolFormat.HERMES, True, THINK, False),
    "opens": ChatFormat(ToolFormat.HERMES, True, THINK, True),
    "llama3": ChatFormat(ToolFormat.LLAMA3, True, None, False),
    "mistral": ChatFormat(ToolFormat.MISTRAL, True, None, False),
    "generic": ChatFormat(ToolFormat.GENERIC, False, None, False),
    "generic-think": ChatFormat(ToolFormat.GENERIC, False, THINK, False),
}
TOOL_FORMATS = [name for name in FORMATS if name != "plain"]
TOOLS = ToolSpec.parse_all([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "HassTurnOn", "description": "Turns on a device", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                         "domain": {"type": "array", "items": {"enum": ["light", "switch"]}}}}}},
])
CHOICES = {"auto": ToolChoice(ToolChoiceMode.AUTO), "required": ToolChoice(ToolChoiceMode.REQUIRED),
           "named": ToolChoice(ToolChoiceMode.FUNCTION, "get_weather")}
RESPONSE = SCHEMAS["support ticket"]


@pytest.fixture(scope="module")
def vocab(default_model_path):
    model = LlamaModel(default_model_path, vocab_only=True)
    yield model
    model.close()


def written(grammar) -> str:
    """What the fake backend answers under ``grammar``, with what a lazy grammar needs before it applies: a
    reply that opens in its reasoning (no trigger matches the call alone) closes it first."""
    text = shortest(grammar.gbnf, grammar.root)
    if grammar.is_lazy and not any(re.search(p, text) for p in grammar.trigger_patterns):
        text = "so" + THINK.end + "\n" + text
    return text


def holds(vocab, grammar) -> None:
    assert compiles(vocab, grammar), grammar.gbnf[:400]
    text = written(grammar)
    assert accepts(vocab, grammar, text), (text, grammar.gbnf[:400])
    if grammar.is_lazy:
        # the grammar did apply: after the call, text it does not allow is refused (vacuous acceptance fails here)
        assert not accepts(vocab, grammar, text + "!"), text


# a schema's grammar depends on the format only through its reasoning block: none, optional, or already open
REASONING = ("plain", "qwen3", "opens")


@pytest.mark.parametrize("fmt", REASONING, ids=str)
@pytest.mark.parametrize("schema", SCHEMAS, ids=str)
def test_llama_cpp_lets_the_model_write_shortest_under_each_schema_s_grammar(vocab, schema, fmt):
    holds(vocab, json_schema_grammar(SCHEMAS[schema], FORMATS[fmt]))


@pytest.mark.parametrize("fmt", REASONING, ids=str)
def test_llama_cpp_lets_the_model_write_shortest_under_the_json_object_grammar(vocab, fmt):
    holds(vocab, json_object_grammar(FORMATS[fmt]))


@pytest.mark.parametrize("response", [False, True], ids=["no response schema", "a response schema"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one call", "parallel"])
@pytest.mark.parametrize("choice", CHOICES, ids=str)
@pytest.mark.parametrize("fmt", TOOL_FORMATS, ids=str)
def test_llama_cpp_lets_the_model_write_shortest_under_each_tool_grammar(vocab, fmt, choice, parallel, response):
    holds(vocab, tool_grammar(FORMATS[fmt], TOOLS, CHOICES[choice], parallel, RESPONSE if response else None))


def test_the_check_can_fail_a_grammar_whose_shortest_llama_cpp_refuses(vocab):
    """The judge is live: a grammar that llama.cpp reads differently from homepd's parser (here, one that homepd's
    fake would answer with text outside it) is caught."""
    from homepd.core.sampling import Grammar
    real = json_schema_grammar(SCHEMAS["support ticket"])
    assert not accepts(vocab, real, shortest(real.gbnf).replace("low", "urgent"))
    assert not accepts(vocab, Grammar('root ::= "a" "b"'), shortest('root ::= "a"'))


# ---- parse refuses what llama.cpp refuses ----------------------------------------------------------------------

CORPUS = [
    # good ones, some with corners of the syntax
    'root ::= "yes" | "no"',
    'root ::= [a-z]+ ("," [a-z]+)* "."',
    'root ::= x\nx ::= "(" x ")" | ""',
    'root ::= ("a"?)* "b"',
    'root ::= "x"{2,5} [0-9]{0,2000} "."',
    'root ::= . [^\\n]* "\\u00e9\\x41"',
    '# a comment\nroot ::= (\n  "a" |\n  "b"\n) tail\ntail ::= "\\["',
    'root ::= a\na ::= b "x" | "y"\nb ::= "z"',
    'root ::= "a"\nroot ::= "b"',
    'root ::= ""',
    'root ::= e "x"\ne ::= "a" e | ""',
    'root ::= ("a"*)* "b"',
    'root ::= (e)* "b"\ne ::= "a"?',  # left recursion through e, a tail call: llama.cpp's seen stacks end it
    'root ::= <[1000]> "a"',
    # bad ones (an empty text is no grammar to llama.cpp, and to homepd's routes: not here)
    'rot ::= "a"',
    'root ::= foo',
    'root ::= ("a"',
    'root ::= "a',
    'root ::= [a-',
    'root := "a"',
    'root ::= "a" "b"\n  | ',
    'root ::= *',
    'root ::= "a"{2001}',
    'root ::= ("a" "b"){1000} ("c"){3}',
    'root ::= "\\q"',
    'root ::= "\\x4"',
    'root ::= <[12',
    'root ::= "a" <think',
    'root ::= <[1000]>',
    'root ::= root "a" | "b"',
    'root ::= a\na ::= b "x" | "y"\nb ::= root',
    'root ::= e root "x" | "y"\ne ::= "a" | ""',
    'root ::= ("" | root) "x"',
    'root ::= x*\nx ::= root "a"',
    'root ::= "a" x\nx ::= x "b" | "c"',
    'root ::= "a" "b" foo-bar\nfoo-bar ::= [^]',  # an empty class is nothing at all to llama.cpp
    'root ::= "a" []*',
    'root ::= "a" [^]{2}',
]


def llama_refuses(text: str) -> bool:
    _init_backend()
    sampler = C.llama_sampler_init_grammar(None, text.encode(), b"root")
    if sampler:
        C.llama_sampler_free(sampler)
    return not sampler


def homepd_refuses(text: str) -> bool:
    try:
        parse(text, tokens=True).rule_id("root")
    except GbnfError:
        return True
    return False


@pytest.mark.parametrize("text", CORPUS, ids=[t.replace("\n", " / ")[:40] for t in CORPUS])
def test_parse_refuses_exactly_what_llama_cpp_refuses(text):
    assert homepd_refuses(text) == llama_refuses(text)


# grammars llama.cpp cannot be given at all, since it does not refuse them and then exhausts the box's memory:
# * left recursion through a rule empty only through others (e ::= "a"?) passes its check, and each turn of the
#   recursion pushes one more stack element (measured: 24 GB in seconds, then the OOM killer);
# * a repetition whose maximum is under its minimum: its count of optional copies (max - min) wraps around.
# homepd refuses them before llama.cpp sees them (``homepd.llm.sampler.grammar_sampler``).
EXHAUSTING = [
    'root ::= e root "x" | "y"\ne ::= "a"?',
    'root ::= x "!"\nx ::= ("a"? | "b"?) x "z" | "c"',
    'root ::= a\na ::= b a "x" | "y"\nb ::= c\nc ::= "q" | ""',
    'root ::= "a"{3,2}',
]


@pytest.mark.parametrize("text", EXHAUSTING, ids=[t.replace("\n", " / ")[:40] for t in EXHAUSTING])
def test_parse_refuses_what_would_exhaust_llama_cpp(text):
    assert homepd_refuses(text)
    with pytest.raises(GbnfError, match="left-recursive|a maximum of at least the minimum"):
        parse(text)


@pytest.mark.parametrize("text", [EXHAUSTING[0], EXHAUSTING[-1]])
def test_a_client_grammar_that_would_exhaust_llama_cpp_is_refused_before_llama_cpp_sees_it(vocab, text):
    """What the controller's check (``LlamaModel.check_grammar``) and every worker's sampler go through: a clear
    RequestError (a 400 at the HTTP edge), where llama.cpp itself would take the process down."""
    from homepd.core.sampling import Grammar
    from homepd.errors import RequestError
    with pytest.raises(RequestError, match="grammar cannot be used: (rule 'root' is left-recursive|.*a maximum)"):
        vocab.check_grammar(Grammar(text))


def test_the_corpus_holds_both_kinds():
    refused = [t for t in CORPUS if llama_refuses(t)]
    assert 10 <= len(refused) <= len(CORPUS) - 10
    assert any("root ::= root" in t for t in refused)  # left recursion is among them
