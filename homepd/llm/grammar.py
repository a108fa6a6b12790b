"""Grammars for structured output and tool calls, built with llama.cpp's JSON-schema-to-GBNF converter.

``check_schema`` refuses (RequestError naming the path and the keyword) any schema the grammar could not
enforce: a schema homepd accepts is one every generated value satisfies, never one it partly ignores.  It
does so by rewriting the schema into a canonical form that keeps only what the converter honours; the
converter (``llama_cpp.llama_grammar.SchemaConverter``, subclassed to fix what it gets wrong and to enforce
integer bounds as llama.cpp's C++ converter does) then turns that form into GBNF, and llama.cpp parses the
result before a request is admitted.  ``json_schema_grammar``, ``json_object_grammar`` and ``tool_grammar``
build the ``Grammar`` a request samples under; where a ChatFormat thinks, they let a reasoning block come first.
"""
from __future__ import annotations

import json
import re

import llama_cpp as C
from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, BuiltinRule, SchemaConverter

from homepd.chat.format import ChatFormat, ToolChoice, ToolChoiceMode, ToolFormat, ToolSpec
from homepd.structured.gbnf import class_char
from homepd.structured.schema import canonical_schema
from homepd.core.sampling import Grammar
from homepd.structured.intrange import int_range_gbnf
from homepd.structured.limits import MAX_REPEAT, Budget
from homepd.errors import RequestError
from homepd.llm import _init_backend

RESPONSE_SCHEMA_PATH = "response_format.json_schema.schema"
# why: the shipped rule is [^"\\], which lets a raw newline or other control character into a JSON string
_JSON_CHAR = BuiltinRule(r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
                         r'[0-9a-fA-F])', [])
_PLAIN_KEY_CHAR = r'[^"\\\x7F\x00-\x1F]'
_THINK_GAP = r'[ \t\n]{0,4}'    # between a reasoning block's end and what follows


def check_schema(schema: object, path: str = RESPONSE_SCHEMA_PATH) -> None:
    """Raise RequestError (naming the JSON path and the keyword) unless the grammar can enforce ``schema``."""
    canonical_schema(schema, path, Budget())


def json_schema_grammar(schema: object, fmt: ChatFormat | None = None, path: str = RESPONSE_SCHEMA_PATH) -> Grammar:
    """A grammar whose every string is a JSON value satisfying ``schema`` (after a reasoning block where ``fmt``
    thinks)."""
    conv = _Converter()
    body = conv.visit_document(schema, path, "json", Budget())
    return _finish(conv, body, fmt, "json_schema")


def json_object_grammar(fmt: ChatFormat | None = None) -> Grammar:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    conv = _Converter()
    body = conv.visit_document({"type": "object"}, "response_format", "json", Budget())
    return _finish(conv, body, fmt, "json_object")


def tool_grammar(fmt: ChatFormat, tools: tuple[ToolSpec, ...], choice: ToolChoice, parallel: bool,
                 response_schema: object | None = None) -> Grammar | None:
    """The grammar of the tool calls ``choice`` allows, in ``fmt``'s syntax, each call's arguments following its
    tool's parameter schema; ``parallel``: one or more calls, else exactly one.

    None for choice none.  For auto in a format with call markers, a lazy grammar: free text until a call's
    opener (``Grammar.trigger_patterns``), then calls only.  For required or a named function, and for GENERIC
    (whose reply is the JSON envelope), a grammar that applies from the first token.  ``response_schema`` (a
    ``response_format`` beside the tools): with auto, an answer that is not a call follows it (GENERIC: the
    envelope's ``response`` is that value; otherwise the reply is a call or that value, from the first token)."""
    if choice.mode is ToolChoiceMode.NONE or not tools:
        return None
    conv, budget = _Converter(), Budget()
    calls = []
    for i, tool in enumerate(tools):
        if choice.mode is ToolChoiceMode.FUNCTION and tool.name != choice.name:
            continue
        args = conv.visit_document(tool.parameters, f"tools[{i}].function.parameters", f"tool-{tool.name}-args",
                                   budget, namespace=f"tools[{i}]")
        calls.append(_call_rule(conv, fmt.tools, tool.name, args))
    if not calls:
        raise RequestError(f"tool_choice.function.name {choice.name!r} is not one of the tools")
    one = conv.add_rule("tool-call", " | ".join(calls))
    if fmt.tools is ToolFormat.GENERIC:
        listed = f'{one} ( "," space {one} )*' if parallel else one
        tool_calls = f'{_lit(json.dumps("tool_calls"))} space ":" space "[" space {listed} "]" space'
        if choice.mode is ToolChoiceMode.AUTO:
            answer = conv._add_primitive("string", PRIMITIVE_RULES["string"]) if response_schema is None else \
                conv.visit_document(response_schema, RESPONSE_SCHEMA_PATH, "response", budget, namespace="response")
            tool_calls = f'( {tool_calls} | {_lit(json.dumps("response"))} space ":" space {answer} )'
        return _finish(conv, conv.add_rule("envelope", f'"{{" space {tool_calls} "}}" space'), fmt, "tools")
    if fmt.tools is ToolFormat.HERMES:
        item = conv.add_rule("hermes-call", f'{_lit(fmt.tools.opener)} "\\n"? space {one} "\\n"? '
                                            f'{_lit(fmt.tools.closer)}')
        body = f'{item} ( "\\n"{{0,2}} {item} )*' if parallel else item
    elif fmt.tools is ToolFormat.MISTRAL:
        listed = f'{one} ( "," space {one} )*' if parallel else one
        body = f'{_lit(fmt.tools.opener)} space "[" space {listed} "]" space'
    else:  # LLAMA3: one call at a time (Llama 3.1/3.2 write no parallel calls)
        body = f'{_lit(fmt.tools.opener)}? {one}'
    body = conv.add_rule("tool-calls", body)
    if choice.mode is ToolChoiceMode.AUTO and response_schema is not None:
        answer = conv.visit_document(response_schema, RESPONSE_SCHEMA_PATH, "response", budget, namespace="response")
        return _finish(conv, conv.add_rule("call-or-answer", f"{body} | {answer}"), fmt, "tools")
    if choice.mode is ToolChoiceMode.AUTO:
        return _finish(conv, body, None, "tools", trigger_patterns(fmt))
    return _finish(conv, body, fmt, "tools")


def trigger_patterns(fmt: ChatFormat) -> tuple[str, ...]:
    """The regexes (ECMAScript, searched in the text generated so far) whose first group starts a call in
    ``fmt``: its opener anywhere after the reasoning, and LLAMA3's bare JSON call where the content starts.
    # why: each pattern's group must start text the grammar accepts, or llama.cpp aborts replaying it."""
    starts = [(_ecma_escape(fmt.tools.opener), True)]
    if fmt.tools is ToolFormat.LLAMA3:
        starts.append((r'\{[ \t\n]*"name"', False))
    patterns: list[str] = []
    for opener, anywhere in starts:
        if fmt.think is None:
            patterns.append(opener if anywhere else rf"^\s*({opener})")
            continue
        end = _ecma_escape(fmt.think.end)
        patterns.append(rf"{end}[\s\S]*?({opener})" if anywhere else rf"{end}\s*({opener})")
        if not fmt.opens_thinking:
            no_think = rf"^(?!\s*{_ecma_escape(fmt.think.start)})"
            patterns.append(rf"{no_think}[\s\S]*?({opener})" if anywhere else rf"^\s*({opener})")
    return tuple(patterns)


def _call_rule(conv: _Converter, fmt: ToolFormat, name: str, args: str) -> str:
    key = _lit(json.dumps(fmt.arguments_key))
    # why: LLAMA3's trigger ends inside '{ "name"'; the grammar must accept whatever whitespace it matched
    start = '"{" [ \\t\\n]*' if fmt is ToolFormat.LLAMA3 else '"{" space'
    return (f'{start} {_lit(json.dumps("name"))} space ":" space {_lit(json.dumps(name, ensure_ascii=False))} '
            f'space "," space {key} space ":" space {args} "}}" space')


def _finish(conv: _Converter, body: str, fmt: ChatFormat | None, origin: str,
            patterns: tuple[str, ...] = ()) -> Grammar:
    root = body
    if fmt is not None and fmt.think is not None:
        text = _text_until(conv, fmt.think.end, "think-text")
        closed = f'{text} {_lit(fmt.think.end)} {_THINK_GAP}'
        root = f'{closed} {body}' if fmt.opens_thinking else f'( {_lit(fmt.think.start)} {closed} )? {body}'
    root_name = conv.add_rule("root", root)
    assert root_name == "root", root_name
    gbnf = conv.format_grammar()
    _check_parses(gbnf, origin)
    return Grammar(gbnf, origin, "root", patterns)


def _check_parses(gbnf: str, origin: str) -> None:
    """RequestError unless llama.cpp parses ``gbnf`` (no vocabulary is needed to parse one)."""
    _init_backend()
    sampler = C.llama_sampler_init_grammar(None, gbnf.encode("utf-8"), b"root")
    if not sampler:
        raise RequestError(f"the {origin} grammar built from this request does not parse in llama.cpp (a "
                           "repetition too large for it, or a recursion with no end?); simplify the schema")
    C.llama_sampler_free(sampler)


def _text_until(conv: _Converter, marker: str, name: str) -> str:
    """A rule for any text that does not contain ``marker`` (the states of a matcher for it, KMP-style), so the
    grammar can ask for ``text marker``."""
    def next_state(k: int, c: str) -> int:
        s = marker[:k] + c
        while s and not marker.startswith(s):
            s = s[1:]
        return len(s)

    chars = sorted(set(marker))
    others = "".join(class_char(c) for c in chars)
    for k in range(len(marker)):
        alts = [""]
        for c in chars:
            j = next_state(k, c)
            if j < len(marker):
                alts.append(f"{_lit(c)} {name}-{j}")
        alts.append(f"[^{others}] {name}-0")
        conv.add_rule(f"{name}-{k}", " | ".join(alts))
    return f"{name}-0"


def _lit(text: str) -> str:
    """``text`` as a GBNF literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'




def _ecma_escape(text: str) -> str:
    return re.sub(r"([\\^$.|?*+()\[\]{}/])", r"\\\1", text)


# ---- the converter ------------------------------------------------------------------------------------

class _Converter(SchemaConverter):
    """The shipped converter, visiting canonical schemas (``canonical_schema``) and fixed where it is wrong:
    literals escape backslashes; JSON strings exclude control characters; a property's additional keys cannot
    repeat a declared name; integer bounds are enforced (llama.cpp's C++ ``build_min_max_int``); $refs resolve
    in their own document and name their rules apart from properties."""

    def __init__(self):
        super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        self.defs: dict[str, dict] = {}
        self._ref_rules: dict[str, str] = {}

    def visit_document(self, schema: object, path: str, name: str, budget: Budget, namespace: str = "") -> str:
        root = canonical_schema(schema, path, budget, self.defs, namespace)
        return self.visit(root, name)

    def add_rule(self, name: str, rule: str) -> str:
        return self._add_rule(name, rule)

    def _format_literal(self, literal: str) -> str:
        return _lit(literal)

    def _generate_constant_rule(self, value) -> str:
        return _lit(json.dumps(value, ensure_ascii=False))

    def _add_primitive(self, name: str, rule: BuiltinRule) -> str:
        return super()._add_primitive(name, _JSON_CHAR if rule is PRIMITIVE_RULES["char"] else rule)

    def visit(self, schema: dict, name: str) -> str:
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        kind = schema.get("type")
        if "$ref" in schema:
            return self._add_rule(rule_name, self._ref_rule(schema["$ref"]))
        if kind == "any":
            return self._add_rule(rule_name, self._add_primitive("value", PRIMITIVE_RULES["value"]))
        if kind == "integer" and ("minimum" in schema or "maximum" in schema):
            return self._add_rule(rule_name, f"({int_range_gbnf(schema.get('minimum'), schema.get('maximum'))}) space")
        if kind == "number" and "minimum" in schema:   # canonical: only minimum 0
            for part in ("integral-part", "decimal-part"):
                self._add_primitive(part, PRIMITIVE_RULES[part])
            return self._add_rule(rule_name, 'integral-part ("." decimal-part)? ([eE] [-+]? integral-part)? space')
        if kind == "object" and (schema["properties"] or schema["additionalProperties"] is not True):
            return self._add_rule(rule_name, self._object(schema, name))
        if kind == "object":
            return self._add_rule(rule_name, self._add_primitive("object", PRIMITIVE_RULES["object"]))
        return super().visit(schema, name)

    def _ref_rule(self, key: str) -> str:
        if key not in self._ref_rules:
            base = "ref-" + key.rsplit("/", 1)[-1]
            name = self._add_rule(base, f"<{key}>")   # reserved now, so a recursive reference finds it
            self._ref_rules[key] = name
            self._rules[name] = self.visit(self.defs[key], name + "-value")
        return self._ref_rules[key]

    def _object(self, schema: dict, name: str) -> str:
        """The shipped ``_build_object_rule``, except that additional keys exclude the declared ones and follow
        a declared optional property with their comma (as the C++ converter writes them)."""
        properties, required, additional = schema["properties"], set(schema["required"]), schema["additionalProperties"]
        prefix = f"{name}-" if name else ""
        kv: dict[str | None, str] = {}
        for prop, sub in properties.items():
            value = self.visit(sub, f"{prefix}{prop or 'p'}")
            kv[prop] = self._add_rule(f"{prefix}{prop or 'p'}-kv", f'{_lit(json.dumps(prop, ensure_ascii=False))} '
                                                                   f'space ":" space {value}')
        required_props = [p for p in properties if p in required]
        optional: list[str | None] = [p for p in properties if p not in required]
        if additional is not False:
            value = self.visit(additional if isinstance(additional, dict) else {"type": "any"},
                               f"{prefix}additional-value")
            key = self._add_rule(f"{prefix}additional-k", self._key_not_in(list(properties)))
            kv[None] = self._add_rule(f"{prefix}additional-kv", f'{key} ":" space {value}')
            optional.append(None)

        # why: the shipped converter builds each alternative's chain of the optional properties after it anew,
        # recursively (quadratic; a RecursionError at 1,000): the chains share their tails, so build those once
        def comma(k: str | None) -> str:
            return f'( "," space {kv[k]} )' + ("*" if k is None else "?")

        tails: list[str] = [""] * (len(optional) + 1)   # tails[j]: optional[j:], each after its comma
        for j in range(len(optional) - 1, 0, -1):
            body = f"{comma(optional[j])} {tails[j + 1]}".rstrip()
            tails[j] = self._add_rule(f"{prefix}{optional[j - 1] or 'p'}-rest", body)
        chains = []
        for i, k in enumerate(optional):   # alternative i: optional[i] first, then the later ones
            head = kv[k] if k is not None else f"{kv[k]} {comma(k)}"
            chains.append(f"{head} {tails[i + 1]}".rstrip())

        rule = '"{" space ' + ' "," space '.join(kv[p] for p in required_props)
        if optional:
            alternatives = " | ".join(chains)
            rule += f' ( "," space ( {alternatives} ) )?' if required_props else f" ( {alternatives} )?"
        return rule + ' "}" space'

    def _key_not_in(self, names: list[str]) -> str:
        """A JSON string that is none of ``names`` (written without escapes, so the check is exact)."""
        if not names:
            return self._add_primitive("string", PRIMITIVE_RULES["string"])
        plain = self._add_rule("plain-key-char", _PLAIN_KEY_CHAR)
        trie: dict = {}
        for n in names:
            if not re.search(r'["\\\x00-\x1F\x7F]', n):   # a name with escapes cannot be written plain anyway
                node = trie
                for c in n:
                    node = node.setdefault(c, {})
                node[""] = {}

        def strings(node: dict) -> str:
            chars = sorted(c for c in node if c)
            alts = [f"[{class_char(c)}] ({strings(node[c])})" if any(node[c]) else f"[{class_char(c)}] {plain}+"
                    for c in chars]
            alts.append(f'[^"\\\\\\x7F\\x00-\\x1F{"".join(class_char(c) for c in chars)}] {plain}*')
            body = " | ".join(alts)
            return body if "" in node else f"( {body} )?"

        return f'"\\"" {strings(trie)} "\\"" space'


__all__ = ["MAX_REPEAT", "check_schema", "int_range_gbnf", "json_object_grammar", "json_schema_grammar",
           "tool_grammar", "trigger_patterns"]
