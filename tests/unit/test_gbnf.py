"""GBNF parsing, shortest derivations and recognition (homepd.structured.gbnf), on hand-written grammars and on the
grammars llama-cpp-python's JSON-schema converter writes."""
import itertools
import json
import time

import pytest
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

from earley import accepts
from homepd.structured.gbnf import CharSet, Gbnf, GbnfError, parse, shortest


def language(g: Gbnf, alphabet: str, max_len: int, root: str = "root") -> set[str]:
    """Every string of at most max_len characters of alphabet that root derives, by brute force over g.rules."""
    derived: list[set[str]] = [set() for _ in g.rules]
    changed = True
    while changed:
        changed = False
        for rule, alts in enumerate(g.rules):
            for symbols in alts:
                partial = {""}
                for symbol in symbols:
                    options = ({ch for ch in alphabet if symbol.matches(ord(ch))} if isinstance(symbol, CharSet)
                               else derived[symbol])
                    partial = {p + o for p in partial for o in options if len(p) + len(o) <= max_len}
                if partial - derived[rule]:
                    derived[rule] |= partial
                    changed = True
    return derived[g.rule_id(root)]


def schema_grammar(schema: dict) -> str:
    return json_schema_to_gbnf(json.dumps(schema))


# --- hand-written grammars -------------------------------------------------------------------------------------

def test_literals_and_classes_give_their_first_printable_choice_letters_before_digits():
    # [0-9] allows no letter, so its least digit; [a-f] and the JSON string class both allow "a"
    assert shortest(r'root ::= "id-" [0-9] [a-f] [^"\\\x00-\x1F] [ \t\n]') == "id-0aa "


def test_a_class_with_no_printable_ascii_gives_the_first_printable_character_beyond_it():
    # U+0080..U+009F are C1 controls and U+00A0 is a no-break space; U+00A1 is the first printable one
    assert shortest(r"root ::= [^\x00-\x7F]") == "\u00a1"
    assert shortest(r'root ::= "\n" [\x00-\x08]') == "\n\x00"  # nothing printable allowed: the grammar wants it


def test_any_char_gives_a_letter_and_accepts_any_character():
    assert shortest("root ::= . .") == "aa"
    assert accepts("root ::= . .", "\n\u00e9") and not accepts("root ::= . .", "abc")


def test_repetitions_take_their_minimum_counts_and_accept_exactly_their_bounds():
    grammar = 'root ::= "x"{3} "y"{2,} "z"{1,4} "w"* "v"+ "u"?'
    assert shortest(grammar) == "xxxyyzv"
    assert accepts(grammar, "xxxyyyyyzzzzwwvvu")
    assert not accepts(grammar, "xxxyyzzzzzv")  # five z
    assert not accepts(grammar, "xxyyzv")  # two x
    assert not accepts(grammar, "xxxyzv")  # one y


def test_a_repetition_applies_to_the_whole_preceding_string_or_group():
    assert shortest('root ::= "ab"{2} ("c" "d"){2}') == "ababcdcd"
    assert accepts('root ::= "ab"+', "ababab") and not accepts('root ::= "ab"+', "aba")


def test_the_shortest_alternative_wins_and_the_first_of_equal_ones():
    assert shortest('root ::= "long" | "ab" | "cd"') == "ab"
    assert shortest('root ::= two | "xy"\ntwo ::= "q" [q]') == "qq"


def test_recursion_ends_at_the_base_case():
    arithmetic = 'root ::= expr\nexpr ::= "(" expr ")" | term "+" expr | term\nterm ::= [1-9] [0-9]*'
    assert shortest(arithmetic) == "1"
    assert accepts(arithmetic, "1+(20+((3)))") and not accepts(arithmetic, "(1+20)+3")  # "(..)" ends an expr
    right = 'root ::= item "," root | item\nitem ::= "i"'
    assert shortest(right) == "i"
    assert accepts(right, "i,i,i") and not accepts(right, "i,,i")


@pytest.mark.parametrize("grammar, rule", [
    ('root ::= root "," item | item\nitem ::= "i"', "root"),
    ('root ::= a "!"\na ::= b | ""\nb ::= a', "a"),             # through each other
    ('root ::= e root "x" | "y"\ne ::= "a"?', "root"),          # through a rule that may be empty
])
def test_a_left_recursive_rule_is_refused_naming_it_as_llama_cpp_refuses_it(grammar, rule):
    with pytest.raises(GbnfError, match=f"rule '{rule}' is left-recursive"):
        parse(grammar)


def test_rules_that_can_derive_empty_through_each_other_do_not_loop():
    assert shortest('root ::= ("a"?)* "b"') == "b"
    assert accepts('root ::= ("a"*)* "b"', "a" * 200 + "b")


def test_comments_newlines_in_groups_and_after_a_bar_and_escapes():
    grammar = r'''
# the first line is a comment
root ::= (
    "\x41\u00e9"   # A, e acute
  | "\t\"\\"
  ) tail  # the group's shorter alternative is the first
tail ::= "\[" |
  "\]\n" | "\U0001F600"
my-rule2 ::= "unused"
'''
    assert shortest(grammar) == "A\u00e9["
    assert accepts(grammar, '\t"\\]\n') and accepts(grammar, "A\u00e9\U0001F600")
    assert not accepts(grammar, "A\u00e9]")


def test_a_class_reads_dashes_at_its_ends_literally():
    assert accepts("root ::= [a-]+", "-a-") and not accepts("root ::= [a-]+", "b")
    assert accepts(r"root ::= [\-z]", "-") and not accepts(r"root ::= [\-z]", "m")


def test_a_large_bounded_repetition_is_recognised_up_to_its_bound():
    grammar = 'root ::= [0-9]{0,400} "."'
    assert shortest(grammar) == "."
    assert accepts(grammar, "7" * 400 + ".")
    assert not accepts(grammar, "7" * 401 + ".")


def test_nested_repetitions_are_recognised():
    grammar = 'root ::= ("ab"{0,50})* "c"'
    assert accepts(grammar, "ab" * 120 + "c")
    assert not accepts(grammar, "aba" + "c")


@pytest.mark.parametrize("grammar", [
    'root ::= "a" root | "b" | ""',
    'root ::= x y\nx ::= "a"? | y\ny ::= "b"{1,2} x | ""',
    'root ::= ([ab] [^a]?){2,3} | "c"+',
    'root ::= "(" root ")" root | [ab]{0,2}',
    'root ::= (("a" | "") "b"?)+ "c"',
])
def test_accepts_and_shortest_agree_with_a_brute_force_enumeration(grammar):
    g = parse(grammar)
    derived = language(g, "abc()", 5)
    for length in range(6):
        for letters in itertools.product("abc()", repeat=length):
            s = "".join(letters)
            assert accepts(g, s) == (s in derived), s
    assert shortest(g) in derived and len(shortest(g)) == min(map(len, derived))


def test_a_parsed_grammar_can_be_reused():
    g = parse('root ::= "x" item\nitem ::= [0-9]')
    assert shortest(g) == shortest('root ::= "x" item\nitem ::= [0-9]') == "x0"
    assert shortest(g, root="item") == "0" and accepts(g, "5", root="item")


# --- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grammar, where, expected", [
    ('root ::= a\na ::= "x"\nb ::= [abc', "line 3, column 11", "']'"),
    ('root ::= "a" )', "line 1, column 14", "a newline or the end"),
    ('root ::= ("a"', "line 1, column 14", "')'"),
    ('root ::= "a\\q"', "line 1, column 12", "an escape"),
    ('root ::= "\\x4"', "line 1, column 13", "2 hex digits"),
    ('root ::= "a"{3,2}', "line 1, column 13", "a maximum of at least the minimum 3"),
    ('root ::= "a" | *', "line 1, column 16", "an item before '*'"),
    ('root ::= "a"\n  | "b"', "line 2, column 3", "a rule name"),  # a newline ends a rule unless after |
    ('root = "a"', "line 1, column 6", "'::='"),
    ("root ::= <think> .*", "line 1, column 10", "token references"),
    ("root ::= [^]*", "line 1, column 13", "an item before '*'"),  # an empty class is nothing, as to llama.cpp
])
def test_syntax_errors_name_the_line_column_and_what_was_expected(grammar, where, expected):
    with pytest.raises(GbnfError) as error:
        parse(grammar)
    assert where in str(error.value) and expected in str(error.value)
    assert isinstance(error.value, ValueError)


def test_an_undefined_rule_is_named_with_where_it_is_used():
    with pytest.raises(GbnfError, match=r"undefined rule 'item' \(referred to at line 2, column 10\)"):
        parse('root ::= "[" list "]"\nlist ::= item ("," item)*\nitme ::= "x"')


def test_a_missing_root_is_an_error_naming_it():
    with pytest.raises(GbnfError, match="no rule 'root'"):
        shortest('a ::= "x"')
    assert shortest('a ::= "x"', root="a") == "x"


def test_a_root_that_never_terminates_names_the_recursing_rule():
    with pytest.raises(GbnfError) as error:
        shortest('root ::= "<" a ">"\na ::= "x" a | "y" (a)')
    assert "no alternative of rule 'a' ever ends" in str(error.value)
    assert shortest('root ::= "x" | a\na ::= "x" a') == "x"  # a rule that is never needed does not matter


def test_a_repetition_creating_too_many_rules_is_refused_as_llama_cpp_does():
    with pytest.raises(GbnfError, match="at most 2000 rules"):
        parse('root ::= ("a"{0,100}){0,30}')


# --- grammars from llama-cpp-python's JSON-schema converter ---------------------------------------------------

PERSON = {"type": "object", "required": ["name", "age", "is_admin"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "is_admin": {"type": "boolean"}}}


def test_a_required_fields_object_gives_json_with_each_field_of_its_type():
    grammar = schema_grammar(PERSON)
    doc = json.loads(shortest(grammar))
    assert set(doc) == {"name", "age", "is_admin"}
    assert isinstance(doc["name"], str) and type(doc["age"]) is int and isinstance(doc["is_admin"], bool)
    assert doc["name"] == "" and doc["age"] == 0  # the shortest string and integer
    assert accepts(grammar, shortest(grammar))
    assert accepts(grammar, json.dumps({"name": "Ada \u00e9 \"q\"", "age": -42, "is_admin": False}))


def test_a_required_fields_object_rejects_a_missing_field_a_wrong_type_and_trailing_garbage():
    grammar = schema_grammar(PERSON)
    assert not accepts(grammar, json.dumps({"name": "a", "is_admin": True}))
    assert not accepts(grammar, json.dumps({"name": "a", "age": "1", "is_admin": True}))
    assert not accepts(grammar, shortest(grammar) + "x")


def test_nested_objects_give_every_required_level():
    schema = {"type": "object", "required": ["user", "score"], "properties": {
        "score": {"type": "number"},
        "user": {"type": "object", "required": ["id", "address"], "properties": {
            "id": {"type": "integer"},
            "address": {"type": "object", "required": ["zip"],
                        "properties": {"zip": {"type": "string", "minLength": 5, "maxLength": 5}}}}}}}
    grammar = schema_grammar(schema)
    doc = json.loads(shortest(grammar))
    assert set(doc) == {"user", "score"} and set(doc["user"]) == {"id", "address"}
    assert len(doc["user"]["address"]["zip"]) == 5 and isinstance(doc["score"], (int, float))
    assert accepts(grammar, shortest(grammar))
    assert not accepts(grammar, json.dumps({"user": {"id": 1, "address": {"zip": "1234"}}, "score": 1}))


def test_an_array_with_min_items_gives_that_many_items():
    schema = {"type": "array", "minItems": 2, "maxItems": 40,
              "items": {"type": "object", "required": ["k"], "properties": {"k": {"type": "string"}}}}
    grammar = schema_grammar(schema)
    doc = json.loads(shortest(grammar))
    assert doc == [{"k": ""}, {"k": ""}]
    assert accepts(grammar, shortest(grammar)) and accepts(grammar, json.dumps([{"k": "a"}] * 40))
    assert not accepts(grammar, json.dumps([{"k": "a"}])) and not accepts(grammar, json.dumps([{"k": "a"}] * 41))


def test_an_enum_gives_its_shortest_value_and_rejects_others():
    schema = {"type": "object", "required": ["color"], "properties": {"color": {"enum": ["green", "red", "blue"]}}}
    grammar = schema_grammar(schema)
    assert json.loads(shortest(grammar)) == {"color": "red"}
    assert accepts(grammar, '{"color": "blue"}') and not accepts(grammar, '{"color": "pink"}')


def test_optional_properties_are_left_out_but_accepted():
    schema = {"type": "object", "required": ["id"],
              "properties": {"id": {"type": "integer"}, "note": {"type": "string"}, "tags": {"type": "array"}}}
    grammar = schema_grammar(schema)
    assert json.loads(shortest(grammar)) == {"id": 0}
    assert accepts(grammar, json.dumps({"id": 3, "note": "n", "tags": [1, "x", None]}))
    assert not accepts(grammar, json.dumps({"note": "n"}))


def test_a_tool_call_with_alternative_argument_shapes_gives_one_of_them():
    schema = {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"enum": ["get_weather", "search"]},
        "arguments": {"anyOf": [
            {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
            {"type": "object", "required": ["q"], "properties": {"q": {"type": "string", "maxLength": 100}}}]}}}
    grammar = schema_grammar(schema)
    doc = json.loads(shortest(grammar))
    assert doc["name"] == "search" and doc["arguments"] in ({"city": ""}, {"q": ""})
    assert accepts(grammar, shortest(grammar))
    assert not accepts(grammar, json.dumps({"name": "search", "arguments": {"q": "x" * 101}}))


def test_the_generic_json_grammar_gives_an_empty_object_and_recognises_real_json():
    assert shortest(JSON_GBNF) == "{}"  # root is an object, and ws may be empty
    doc = json.dumps({"a": [1, -2.5e3, "x\u00e9", None, True, {}], "b": {"c": "d" * 200}}, indent=1)
    assert len(doc) > 250 and accepts(JSON_GBNF, doc)
    assert not accepts(JSON_GBNF, '{"a": [1, 2,]}') and not accepts(JSON_GBNF, '{"a": 01}')


def test_shortest_is_fast_on_converter_grammars_and_accepts_is_not_exponential():
    schemas = [PERSON, {"type": "object", "additionalProperties": True},
               {"type": "array", "minItems": 2, "items": PERSON}]
    for schema in schemas:
        grammar = schema_grammar(schema)
        started = time.perf_counter()
        shortest(parse(grammar))
        assert time.perf_counter() - started < 0.05  # why: generous for a loaded CI box; it takes ~1 ms
    doc = json.dumps([{"name": "n" * 40, "age": 12345, "is_admin": True}] * 5)
    started = time.perf_counter()
    assert accepts(schema_grammar(schemas[2]), doc)
    assert time.perf_counter() - started < 2.0
