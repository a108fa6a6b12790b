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
import math
import re
from fractions import Fraction
from urllib.parse import unquote

import llama_cpp as C
from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, BuiltinRule, SchemaConverter

from homepd.core.chatformat import ChatFormat, ToolChoice, ToolChoiceMode, ToolFormat, ToolSpec
from homepd.core.sampling import Grammar
from homepd.errors import RequestError
from homepd.llm import _init_backend

RESPONSE_SCHEMA_PATH = "response_format.json_schema.schema"
_INTEGRAL_DIGITS = 16   # the converter's integer rule writes at most 16 digits
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
    others = "".join(_class_char(c) for c in chars)
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


def _class_char(c: str) -> str:
    """``c`` inside a GBNF character class (hex-escaped, so no character is special)."""
    n = ord(c)
    return f"\\x{n:02X}" if n < 0x100 else f"\\u{n:04X}" if n < 0x10000 else f"\\U{n:08X}"


def _ecma_escape(text: str) -> str:
    return re.sub(r"([\\^$.|?*+()\[\]{}/])", r"\\\1", text)


# ---- what a schema may be: limits, and the canonical form the converter is given ----------------------

MAX_SCHEMA_DEPTH = 32          # JSON nesting (~16 nested objects; OpenAI allows 10): recursion in the checker,
                               # the converter and llama.cpp's grammar stacks grows with it
MAX_SCHEMA_PROPERTIES = 1_000  # in all: each property adds rules, and a grammar of more compiles slowly
MAX_SCHEMA_VALUES = 20_000     # JSON values in all (keys' values, list items)
MAX_SCHEMA_CHARS = 128 * 1024  # characters of keys and strings: about the JSON text's size
MAX_REPEAT = 1_000             # minItems/maxItems/minLength/maxLength and a pattern's {n,m}: the converter writes
                               # a repetition out (nested groups); llama.cpp's own {m,n} silently drops a bound > 2000
MAX_REPEAT_TOTAL = 20_000      # all of a request's repetitions together
MAX_ONE_OF = 64                # oneOf alternatives (each pair is checked to be disjoint)
MAX_PROPERTY_NAME = 256        # characters: the rule keeping extra keys apart from declared ones recurses per one

_ANY = {"type": "any"}
_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
_ANNOTATIONS = frozenset({
    "title", "description", "examples", "default", "$schema", "$id", "$anchor", "$comment", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions",
    # why: OpenAPI's discriminator (pydantic writes it next to oneOf) only names the property that tells the
    # alternatives apart; the alternatives themselves are checked to be disjoint
    "discriminator"})
_OBJECT = frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties"})
_ARRAY = frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"})
_STRING = frozenset({"minLength", "maxLength", "pattern", "format"})
_NUMBER = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_STRING_FORMATS = ("date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5")
_REFUSED = {
    "not": "a grammar cannot exclude another schema's values",
    "if": "conditional schemas are not supported", "then": "conditional schemas are not supported",
    "else": "conditional schemas are not supported",
    "patternProperties": "property names by pattern are not supported; list the properties",
    "propertyNames": "rules on property names are not supported",
    "dependentRequired": "dependencies between properties are not supported",
    "dependentSchemas": "dependencies between properties are not supported",
    "dependencies": "dependencies between properties are not supported",
    "unevaluatedProperties": "not supported; use additionalProperties",
    "unevaluatedItems": "not supported; use items",
    "contains": "constraints on some of an array's items are not supported",
    "minContains": "constraints on some of an array's items are not supported",
    "maxContains": "constraints on some of an array's items are not supported",
    "$dynamicRef": "dynamic references are not supported", "$recursiveRef": "dynamic references are not supported",
    "$dynamicAnchor": "dynamic references are not supported",
    "$recursiveAnchor": "dynamic references are not supported",
    "contentEncoding": "encoded content is not checked", "contentMediaType": "encoded content is not checked",
    "contentSchema": "encoded content is not checked",
    "nullable": "OpenAPI's nullable is not JSON Schema; use \"type\": [\"...\", \"null\"] or anyOf with "
                "{\"type\": \"null\"}",
}
_KNOWN = _OBJECT | _ARRAY | _STRING | _NUMBER | {"$ref", "anyOf", "oneOf", "allOf", "const", "enum", "type"}


class Budget:
    """What one request's schemas may add up to (its tools share one)."""

    def __init__(self):
        self.values = self.properties = self.chars = self.repeats = 0

    def repeat(self, n: int, path: str) -> None:
        self.repeats += n
        if self.repeats > MAX_REPEAT_TOTAL:
            raise RequestError(f"{path}: the request's repetitions (minItems, maxItems, minLength, maxLength, "
                               f"pattern counts) add up to more than {MAX_REPEAT_TOTAL}, the most homepd writes "
                               "into a grammar")


def canonical_schema(schema: object, path: str, budget: Budget, defs: dict | None = None,
                     namespace: str = "") -> dict:
    """``schema`` reduced to what the converter enforces, or RequestError naming the path and the keyword it
    would not.  $refs become keys of ``defs`` (prefixed by ``namespace``, so two documents keep theirs apart)."""
    _check_size(schema, path, budget)
    defs = {} if defs is None else defs
    canon = _Canon(schema, path, defs, namespace, budget)
    root = canon.node(schema, path)
    canon.check_recursion()
    return root


def _check_size(schema: object, path: str, budget: Budget) -> None:
    """Refuse a schema over the limits, before anything walks it recursively (a 10,000-property schema stops
    at its first ``properties``)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise RequestError(f"{path}: the schema nests more than {MAX_SCHEMA_DEPTH} levels deep "
                                   "(homepd's limit)")
            budget.values += len(node)
            if isinstance(node, dict):
                props = node.get("properties")
                budget.properties += len(props) if isinstance(props, dict) else 0
                budget.chars += sum(len(k) for k in node if isinstance(k, str))
                children = node.values()
            else:
                children = node
            if budget.properties > MAX_SCHEMA_PROPERTIES:
                raise RequestError(f"{path}: the schema has more than {MAX_SCHEMA_PROPERTIES} properties in all "
                                   "(homepd's limit: each adds rules to the grammar)")
            if budget.values > MAX_SCHEMA_VALUES:
                raise RequestError(f"{path}: the schema has more than {MAX_SCHEMA_VALUES} values in all "
                                   "(homepd's limit)")
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(node, str):
            budget.chars += len(node)
        if budget.chars > MAX_SCHEMA_CHARS:
            raise RequestError(f"{path}: the schema is more than {MAX_SCHEMA_CHARS} characters of names and "
                               "strings (homepd's limit)")


def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_$][\w$-]*", key) else f"{path}[{json.dumps(key)}]"


def _refuse(path: str, keyword: str, why: str) -> RequestError:
    return RequestError(f"{_at(path, keyword)}: {why}; homepd refuses a schema it cannot enforce rather than "
                        "ignore part of it")


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _has_type(value: object, name: str) -> bool:
    if name == "integer":
        return _kind(value) == "number" and float(value).is_integer()
    return _kind(value) == name


class _Canon:
    """One schema document's walk into canonical form (see ``canonical_schema``)."""

    def __init__(self, root: object, path: str, defs: dict, namespace: str, budget: Budget):
        self.root, self.path, self.defs, self.namespace, self.budget = root, path, defs, namespace, budget
        self.def_paths: dict[str, str] = {}

    def node(self, s: object, path: str) -> dict:
        if s is True:
            return _ANY
        if s is False:
            raise RequestError(f"{path} is false: no value satisfies it")
        if not isinstance(s, dict):
            raise RequestError(f"{path} must be a JSON Schema (an object, or true/false), got {_kind(s)}")
        keys = {k for k in s if k not in _ANNOTATIONS and not k.startswith("x-")}
        for k in sorted(keys):
            if k in _REFUSED:
                raise _refuse(path, k, _REFUSED[k])
            if k not in _KNOWN:
                raise RequestError(f"{_at(path, k)}: unknown keyword {k!r} (a typo?); homepd refuses what it cannot "
                                   "enforce (vendor keywords may start with x-)")
        if "$ref" in keys:
            self._only(keys, {"$ref"}, path, "$ref")
            return self.ref(s["$ref"], _at(path, "$ref"))
        if "anyOf" in keys or "oneOf" in keys:
            return self.union(s, keys, path)
        if "allOf" in keys:
            return self.all_of(s, keys, path)
        if "const" in keys or "enum" in keys:
            return self.values(s, keys, path)
        types = self.types(s, keys, path)
        if len(types) == 1:
            return self.typed(s, types[0], path)
        return {"anyOf": [self.typed(s, t, path) for t in types]}

    def _only(self, keys: set, allowed: set, path: str, what: str) -> None:
        extra = sorted(keys - allowed)
        if extra:
            raise _refuse(path, extra[0], f"next to {what} it would be ignored (the converter reads only the {what}); "
                                          f"move it into the {what}'s schema")

    def ref(self, ref: object, path: str) -> dict:
        if not isinstance(ref, str):
            raise RequestError(f"{path} must be a string")
        if ref == "#":
            raise RequestError(f"{path}: a $ref to the whole document is not supported; put the schema under $defs "
                               "and refer to it there")
        if not ref.startswith("#/"):
            raise RequestError(f"{path}: $ref {ref!r} points outside this schema; homepd follows only '#/...' "
                               "references within it")
        key = self.namespace + ref
        if key not in self.defs:
            target, target_path = self.resolve(ref, path)
            self.defs[key], self.def_paths[key] = None, target_path   # None: being built (a recursion)
            self.defs[key] = self.node(target, target_path)
        return {"$ref": key}

    def resolve(self, ref: str, path: str) -> tuple[object, str]:
        target, where = self.root, self.path
        for raw in ref[2:].split("/"):
            segment = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and segment in target:
                target, where = target[segment], _at(where, segment)
            elif isinstance(target, list) and segment.isdigit() and int(segment) < len(target):
                target, where = target[int(segment)], _at(where, int(segment))
            else:
                raise RequestError(f"{path}: $ref {ref!r} points at nothing in the schema")
        return target, where

    def union(self, s: dict, keys: set, path: str) -> dict:
        if "anyOf" in keys and "oneOf" in keys:
            raise _refuse(path, "oneOf", "anyOf and oneOf together are not supported")
        word = "oneOf" if "oneOf" in keys else "anyOf"
        self._only(keys, {word}, path, word)
        alternatives = s[word]
        where = _at(path, word)
        if not isinstance(alternatives, list) or not alternatives:
            raise RequestError(f"{where} must be a non-empty list of schemas")
        if word == "oneOf" and len(alternatives) > MAX_ONE_OF:
            raise _refuse(path, word, f"more than {MAX_ONE_OF} alternatives cannot be checked to be disjoint; use "
                                      "anyOf")
        canon = [self.node(a, _at(where, i)) for i, a in enumerate(alternatives)]
        if word == "oneOf":
            for i in range(len(canon)):
                for j in range(i + 1, len(canon)):
                    if not self._disjoint(canon[i], canon[j]):
                        raise _refuse(path, word, f"alternatives {i} and {j} can match the same value, which "
                                                  "oneOf forbids and a grammar cannot rule out; use anyOf if either "
                                                  "may match")
        return canon[0] if len(canon) == 1 else {"anyOf": canon}

    def all_of(self, s: dict, keys: set, path: str) -> dict:
        parts, where = s["allOf"], _at(path, "allOf")
        if not isinstance(parts, list) or not parts:
            raise RequestError(f"{where} must be a non-empty list of schemas")
        rest = {k: s[k] for k in keys - {"allOf"}}
        if len(parts) == 1 and not rest:
            return self.node(parts[0], _at(where, 0))
        merged: dict = {"type": "object", "properties": {}, "required": []}
        for part, part_path in [(p, _at(where, i)) for i, p in enumerate(parts)] + ([(rest, path)] if rest else []):
            for _ in range(MAX_SCHEMA_DEPTH):
                if not (isinstance(part, dict) and "$ref" in part):
                    break
                ref = part["$ref"]
                if not (isinstance(ref, str) and ref.startswith("#/")):
                    self.ref(ref, _at(part_path, "$ref"))   # raises what is wrong with it
                part, part_path = self.resolve(ref, _at(part_path, "$ref"))
            if part is True:
                continue
            part_keys = {k for k in part if k not in _ANNOTATIONS and not k.startswith("x-")} \
                if isinstance(part, dict) else {"?"}
            if part_keys - {"type", "properties", "required"} or part.get("type", "object") != "object":
                raise RequestError(f"{part_path}: allOf is enforced only over object schemas of properties and "
                                   "required; merge these schemas into one")
            for name, sub in (part.get("properties") or {}).items():
                if name in merged["properties"]:
                    raise RequestError(f"{_at(_at(part_path, 'properties'), name)}: the property is in two parts of "
                                       "allOf, and a grammar cannot intersect two schemas; merge them")
                merged["properties"][name] = sub
            merged["required"] += [r for r in part.get("required") or [] if r not in merged["required"]]
        return self.typed(merged, "object", path)

    def values(self, s: dict, keys: set, path: str) -> dict:
        self._only(keys, {"const", "enum", "type"}, path, "const/enum")
        if "enum" in s and (not isinstance(s["enum"], list) or not s["enum"]):
            raise RequestError(f"{_at(path, 'enum')} must be a non-empty list")
        values = s["enum"] if "enum" in s else [s["const"]]
        if "const" in s and "enum" in s:
            values = [v for v in values if _same(v, s["const"])]
        for v in values:
            try:
                json.dumps(v, allow_nan=False)
            except ValueError:
                raise RequestError(f"{path}: enum/const values must be finite JSON numbers") from None
        if "type" in s:
            types = self.types(s, {"type"}, path)
            values = [v for v in values if any(_has_type(v, t) for t in types)]
        unique = list({json.dumps(v, sort_keys=True): v for v in values}.values())
        if not unique:
            raise RequestError(f"{path}: no value of its enum/const has its type, so no value satisfies it")
        return {"const": unique[0]} if len(unique) == 1 else {"enum": unique}

    def types(self, s: dict, keys: set, path: str) -> list[str]:
        given = s.get("type")
        if given is None:
            kinds = [k for k, words in (("object", _OBJECT), ("array", _ARRAY), ("string", _STRING),
                                        ("number", _NUMBER)) if keys & words]
            if len(kinds) > 1:
                raise RequestError(f"{path}: keywords of more than one type ({', '.join(kinds)}) and no \"type\"; "
                                   "give the type")
            return kinds or ["any"]
        names = [given] if isinstance(given, str) else given
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise RequestError(f"{_at(path, 'type')} must be a type name or a non-empty list of them")
        for n in names:
            if n not in _TYPES:
                raise RequestError(f"{_at(path, 'type')}: unknown type {n!r} (one of {', '.join(_TYPES)})")
        return list(dict.fromkeys(names))

    def typed(self, s: dict, kind: str, path: str) -> dict:
        if kind == "any":
            return _ANY
        if kind in ("null", "boolean"):
            return {"type": kind}
        return getattr(self, "_" + kind)(s, path)

    def count(self, s: dict, key: str, path: str) -> int | None:
        v = s.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or not float(v).is_integer():
            raise RequestError(f"{_at(path, key)} must be a non-negative integer")
        if v > MAX_REPEAT:
            raise _refuse(path, key, f"{int(v)} is more than {MAX_REPEAT}, the most homepd writes into a grammar")
        self.budget.repeat(int(v), _at(path, key))
        return int(v)

    def _string(self, s: dict, path: str) -> dict:
        lo, hi = self.count(s, "minLength", path) or 0, self.count(s, "maxLength", path)
        if hi is not None and lo > hi:
            raise RequestError(f"{path}: minLength {lo} > maxLength {hi}, so no string satisfies it")
        pattern, fmt = s.get("pattern"), s.get("format")
        if pattern is not None:
            if fmt is not None:
                raise _refuse(path, "format", "a format is not enforced together with a pattern")
            if lo or hi is not None:
                raise _refuse(path, "minLength" if lo else "maxLength", "a length is not enforced together with a "
                                                                         "pattern; write it into the pattern")
            if not isinstance(pattern, str):
                raise RequestError(f"{_at(path, 'pattern')} must be a string")
            return {"type": "string", "pattern": _Regex(pattern, _at(path, "pattern"), self.budget).convert()}
        if fmt is not None:
            if fmt not in _STRING_FORMATS:
                raise _refuse(path, "format", f"format {fmt!r} is not enforced (only {', '.join(_STRING_FORMATS)})")
            if lo or hi is not None:
                raise _refuse(path, "minLength" if lo else "maxLength", "a length is not enforced together with a "
                                                                         "format")
            return {"type": "string", "format": fmt}
        out = {"type": "string"}
        if lo:
            out["minLength"] = lo
        if hi is not None:
            out["maxLength"] = hi
        return out

    def _integer(self, s: dict, path: str) -> dict:
        lo = hi = None
        for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
            v = s.get(key)
            if v is None:
                continue
            if isinstance(v, bool):
                raise _refuse(path, key, "the draft-4 boolean form is not supported; give the bound as a number")
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RequestError(f"{_at(path, key)} must be a finite number")
            if key == "minimum" or key == "exclusiveMinimum":
                bound = math.ceil(v) if key == "minimum" else math.floor(v) + 1
                lo = bound if lo is None else max(lo, bound)
            else:
                bound = math.floor(v) if key == "maximum" else math.ceil(v) - 1
                hi = bound if hi is None else min(hi, bound)
        multiple = s.get("multipleOf")
        if multiple is not None:
            if isinstance(multiple, bool) or not isinstance(multiple, (int, float)) or not multiple > 0:
                raise RequestError(f"{_at(path, 'multipleOf')} must be a number > 0")
            if (Fraction(1) / Fraction(str(multiple))).denominator != 1:
                raise _refuse(path, "multipleOf", f"multipleOf {multiple} is not enforced on integers (only a "
                                                  "divisor of 1, such as 1 or 0.5, which every integer satisfies)")
        fmt = s.get("format")
        if fmt == "int32":
            lo, hi = max(lo, -2 ** 31) if lo is not None else -2 ** 31, min(hi, 2 ** 31 - 1) if hi is not None \
                else 2 ** 31 - 1
        elif fmt is not None and fmt != "int64":   # int64: the integer rule writes at most 16 digits
            raise _refuse(path, "format", f"format {fmt!r} is not enforced on integers (only int32 and int64)")
        limit = 10 ** _INTEGRAL_DIGITS
        if (lo is not None and lo >= limit) or (hi is not None and hi <= -limit):
            raise RequestError(f"{path}: its bounds leave only integers of more than {_INTEGRAL_DIGITS} digits, "
                               "which the grammar does not write")
        if lo is not None and hi is not None and lo > hi:
            raise RequestError(f"{path}: no integer lies between its bounds")
        out: dict = {"type": "integer"}
        if lo is not None and lo > -limit:
            out["minimum"] = lo
        if hi is not None and hi < limit:
            out["maximum"] = hi
        return out

    def _number(self, s: dict, path: str) -> dict:
        for key in ("maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "format"):
            if key in s:
                raise _refuse(path, key, f"{key} is not enforced on numbers (of the bounds, only minimum 0 is); use "
                                         "an integer, or check the value yourself")
        minimum = s.get("minimum")
        if minimum is None:
            return {"type": "number"}
        if minimum != 0 or isinstance(minimum, bool):
            raise _refuse(path, "minimum", f"minimum {minimum!r} is not enforced on numbers (only minimum 0 is)")
        return {"type": "number", "minimum": 0}

    def _object(self, s: dict, path: str) -> dict:
        props = s.get("properties") or {}
        if not isinstance(props, dict):
            raise RequestError(f"{_at(path, 'properties')} must be an object of schemas")
        where = _at(path, "properties")
        for name in props:
            if len(name) > MAX_PROPERTY_NAME:
                raise RequestError(f"{where}: a property name of {len(name)} characters; homepd allows at most "
                                   f"{MAX_PROPERTY_NAME}")
        canon = {name: self.node(sub, _at(where, name)) for name, sub in props.items()}
        required = s.get("required") or []
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required) \
                or len(set(required)) != len(required):
            raise RequestError(f"{_at(path, 'required')} must be a list of distinct property names")
        for name in required:
            if name not in props:
                raise _refuse(path, "required", f"{name!r} is required but not in properties, so the grammar would "
                                                "never write it; declare it in properties")
        # why: absent means any other property in JSON Schema; next to declared properties the grammar writes
        # none (the converter's way, and what OpenAI's strict mode means), else any
        extra = s.get("additionalProperties", not props)
        if not isinstance(extra, bool):
            extra = self.node(extra, _at(path, "additionalProperties"))
            extra = True if extra == _ANY else extra
        n_min, n_max = self.count(s, "minProperties", path), self.count(s, "maxProperties", path)
        if n_min and n_min > len(required):
            raise _refuse(path, "minProperties", f"only the {len(required)} required properties are sure to be "
                                                 "written; make more of them required")
        if n_max is not None and (extra is not False or n_max < len(props)):
            raise _refuse(path, "maxProperties", "it is enforced only when it allows every declared property and "
                                                 "additionalProperties is false")
        return {"type": "object", "properties": canon, "required": [n for n in props if n in required],
                "additionalProperties": extra}

    def _array(self, s: dict, path: str) -> dict:
        lo, hi = self.count(s, "minItems", path) or 0, self.count(s, "maxItems", path)
        if hi is not None and lo > hi:
            raise RequestError(f"{path}: minItems {lo} > maxItems {hi}, so no array satisfies it")
        if s.get("uniqueItems") is True and (hi is None or hi > 1):
            raise _refuse(path, "uniqueItems", "it is not enforced (a grammar cannot compare items)")
        items, prefix = s.get("items"), s.get("prefixItems")
        fixed = prefix if prefix is not None else items if isinstance(items, list) else None
        if fixed is not None:
            key = "prefixItems" if prefix is not None else "items"
            if not isinstance(fixed, list):
                raise RequestError(f"{_at(path, key)} must be a list of schemas")
            if lo > len(fixed) or (hi is not None and hi < len(fixed)):
                raise _refuse(path, "minItems" if lo > len(fixed) else "maxItems",
                              f"the grammar writes exactly the {len(fixed)} {key}")
            for other in ("items", "additionalItems"):   # checked, though the exact tuple never needs them
                if isinstance(s.get(other), dict) and other != key:
                    self.node(s[other], _at(path, other))
            return {"type": "array", "prefixItems": [self.node(x, _at(_at(path, key), i)) for i, x in enumerate(fixed)]}
        if items is False:
            if lo:
                raise RequestError(f"{path}: items false allows only [], but minItems is {lo}")
            return {"type": "array", "items": _ANY, "minItems": 0, "maxItems": 0}
        out = {"type": "array", "items": _ANY if items in (None, True) else self.node(items, _at(path, "items")),
               "minItems": lo}
        if hi is not None:
            out["maxItems"] = hi
        return out

    # -- checks over the finished document --

    def _target(self, c: dict | None, seen: int = 0) -> dict | None:
        while c is not None and "$ref" in c and seen < MAX_SCHEMA_DEPTH:
            c, seen = self.defs.get(c["$ref"]), seen + 1
        return None if c is None or "$ref" in c else c

    def _kinds(self, c: dict | None) -> set[str]:
        c = self._target(c)
        if c is None or c.get("type") == "any":
            return {"null", "boolean", "number", "string", "array", "object"}
        if "anyOf" in c:
            return set().union(*(self._kinds(a) for a in c["anyOf"]))
        if "const" in c or "enum" in c:
            return {_kind(v) for v in c.get("enum", [c.get("const")])}
        return {"number" if c["type"] == "integer" else c["type"]}

    def _finite(self, c: dict | None) -> set[str] | None:
        c = self._target(c)
        if c is None or not ("const" in c or "enum" in c):
            return None
        return {json.dumps(v, sort_keys=True) for v in c.get("enum", [c.get("const")])}

    def _disjoint(self, a: dict, b: dict) -> bool:
        if not self._kinds(a) & self._kinds(b):
            return True
        va, vb = self._finite(a), self._finite(b)
        if va is not None and vb is not None:
            return not va & vb
        a, b = self._target(a), self._target(b)
        if a is None or b is None or a.get("type") != "object" or b.get("type") != "object":
            return False
        for name in set(a["required"]) & set(b["required"]):
            fa, fb = self._finite(a["properties"][name]), self._finite(b["properties"][name])
            if fa is not None and fb is not None and not fa & fb:
                return True   # a discriminator
        return False

    def check_recursion(self) -> None:
        """Every $ref'd schema must have a finite value, and none may reach itself before a value starts (a
        left recursion, which llama.cpp refuses)."""
        keys = [k for k in self.def_paths]
        ending: set[str] = set()
        grew = True
        while grew:
            grew = False
            for k in keys:
                if k not in ending and self._ends(self.defs[k], ending):
                    ending.add(k)
                    grew = True
        for k in keys:
            if k not in ending:
                raise RequestError(f"{self.def_paths[k]}: this schema refers to itself with no way to end (every "
                                   "value would be infinitely deep); make the recursion optional")
            if k in self._first_refs(self.defs[k], set()):
                raise RequestError(f"{self.def_paths[k]}: this schema refers back to itself before any value "
                                   "starts (through $ref/anyOf only), which no grammar can start")

    def _ends(self, c: dict, ending: set[str]) -> bool:
        if "$ref" in c:
            return c["$ref"] in ending
        if "anyOf" in c:
            return any(self._ends(a, ending) for a in c["anyOf"])
        if c.get("type") == "object":
            return all(self._ends(c["properties"][r], ending) for r in c["required"])
        if c.get("type") == "array":
            if "prefixItems" in c:
                return all(self._ends(x, ending) for x in c["prefixItems"])
            return c["minItems"] == 0 or self._ends(c["items"], ending)
        return True

    def _first_refs(self, c: dict, seen: set[str]) -> set[str]:
        if "$ref" in c:
            key = c["$ref"]
            if key not in seen:
                seen.add(key)
                self._first_refs(self.defs[key], seen)
            return seen
        for a in c.get("anyOf", ()):
            self._first_refs(a, seen)
        return seen


def _same(a: object, b: object) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


# ---- patterns --------------------------------------------------------------------------------------------

_SAFE_LITERAL = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 !#%&',-/:;<=>@_`~")
_JSON_ESCAPED = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))   # what a JSON string must escape
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF))
_LINE_END = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")
MAX_PATTERN_NESTING = 32


class _Regex:
    """A JSON Schema pattern (ECMA-262) rewritten into the regex subset the converter turns into GBNF, so that
    the grammar writes each matching string as JSON: a quote, a backslash or a control character the pattern
    names comes out escaped; ``.``, negated classes and ``\\D\\W\\S`` never write those (narrower, never
    wrong); an unanchored pattern gets any text around it, as JSON Schema's search semantics says.  Refused:
    lookaround, back-references, word boundaries, anchors inside, unicode property escapes."""

    def __init__(self, src: str, path: str, budget: Budget):
        self.src, self.path, self.budget = src, path, budget
        self.i = self.depth = 0

    def error(self, why: str) -> RequestError:
        return RequestError(f"{self.path}: {why} (in pattern {self.src!r}); homepd refuses a pattern it cannot "
                            "enforce")

    def convert(self) -> str:
        src = self.src
        starts = src.startswith("^")
        n_backslashes = len(src) - 1 - len(src[:-1].rstrip("\\"))
        ends = src.endswith("$") and len(src) > starts and n_backslashes % 2 == 0
        self.body = src[int(starts):len(src) - int(ends)]
        out = self.alternation()
        if self.i < len(self.body):
            raise self.error("an unbalanced ')'")
        anything = _negated(()) + "*"
        return f"^{'' if starts else anything}({out}){'' if ends else anything}$"

    def peek(self, n: int = 1) -> str:
        return self.body[self.i:self.i + n]

    def alternation(self) -> str:
        parts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            parts.append(self.sequence())
        return "|".join(parts)

    def sequence(self) -> str:
        items = []
        while self.i < len(self.body) and self.peek() not in ("|", ")"):
            atom = self.atom()
            count = self.quantifier()
            items.append(atom + count if count else atom)
        return "".join(items)

    def quantifier(self) -> str:
        c = self.peek()
        match = _COUNT.match(self.body, self.i) if c == "{" else None
        if c in ("*", "+", "?"):
            self.i += 1
            out = c
        elif match:
            lo = int(match[1])
            hi = lo if match[2] is None else int(match[3]) if match[3] else None
            if max(lo, hi or 0) > MAX_REPEAT:
                raise self.error(f"a count over {MAX_REPEAT}, the most homepd writes into a grammar")
            if hi is not None and hi < lo:
                raise self.error("a count {m,n} with n < m")
            self.budget.repeat(max(lo, hi or 0), self.path)
            self.i = match.end()
            out = "{%d}" % lo if hi == lo else "{%d,}" % lo if hi is None else "{%d,%d}" % (lo, hi)
        else:
            return ""
        if self.peek() == "?":   # lazy: the same strings, for a pattern matched as a whole
            self.i += 1
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and _COUNT.match(self.body, self.i)):
            raise self.error("a quantifier on a quantifier")
        return out

    def atom(self) -> str:
        c = self.peek()
        if c == "(":
            self.i += 1
            if self.peek(2) == "?:":
                self.i += 2
            elif self.peek(2) == "?<" and self.peek(3) not in ("?<=", "?<!") and ">" in self.body[self.i:]:
                self.i = self.body.index(">", self.i) + 1   # a named group is a group
            elif self.peek() == "?":
                raise self.error("lookaround and other (?...) groups are not supported")
            self.depth += 1
            if self.depth > MAX_PATTERN_NESTING:
                raise self.error(f"groups nested more than {MAX_PATTERN_NESTING} deep")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("an unbalanced '('")
            self.i += 1
            self.depth -= 1
            return f"({inner})"
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return _negated(_LINE_END)
        if c == "\\":
            return self.escape()
        if c in ("^", "$"):
            raise self.error("an anchor inside the pattern is not supported; anchor the pattern as a whole, ^...$")
        if c in ("*", "+", "?") or (c == "{" and _COUNT.match(self.body, self.i)):
            raise self.error("a quantifier with nothing to repeat")
        self.i += 1
        return _literal(c)

    def escape(self) -> str:
        got = self.class_escape(outside=True)
        if isinstance(got, tuple):
            return got[1] if got[0] == "negated" else _positive(got[1])
        return _literal(chr(got))

    def class_escape(self, outside: bool = False):
        """The escape at ``self.i``: a code point, or ("ranges"/"negated", ranges) for \\d\\w\\s / \\D\\W\\S."""
        if self.i + 1 >= len(self.body):
            raise self.error("a trailing backslash")
        c = self.body[self.i + 1]
        self.i += 2
        shorthand = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
        if c in shorthand:
            return ("ranges", shorthand[c])
        if c in "DWS":
            if not outside:
                raise self.error(f"\\{c} inside a character class is not supported")
            return ("negated", _negated(shorthand[c.lower()]))
        if c == "b" and not outside:
            return 0x08
        if c in "bB":
            raise self.error("word boundaries (\\b, \\B) are not supported")
        if c.isdigit() and c != "0":
            raise self.error("back-references are not supported")
        if c in "kpPc":
            raise self.error(f"\\{c} escapes are not supported")
        if c == "0":
            if self.peek().isdigit():
                raise self.error("octal escapes are not supported")
            return 0
        if c in _CHAR_ESCAPES:
            return ord(_CHAR_ESCAPES[c])
        if c in "xu":
            n = 2 if c == "x" else 4
            digits = self.peek(n)
            if not re.fullmatch("[0-9a-fA-F]{%d}" % n, digits):
                raise self.error(f"\\{c} needs {n} hex digits (\\u{{...}} needs the u flag, which JSON Schema has not)")
            self.i += n
            code = int(digits, 16)
            low = re.match(r"\\u([dD][c-fC-F][0-9a-fA-F]{2})", self.body[self.i:])
            if 0xD800 <= code < 0xDC00 and low:
                self.i += 6
                code = 0x10000 + ((code - 0xD800) << 10) + (int(low[1], 16) - 0xDC00)
            return code
        if c.isalnum():
            raise self.error(f"an unknown escape \\{c}")
        return ord(c)

    def char_class(self) -> str:
        self.i += 1
        negated = self.peek() == "^"
        self.i += negated
        ranges: list[tuple[int, int]] = []
        while True:
            if self.i >= len(self.body):
                raise self.error("an unbalanced '['")
            if self.peek() == "]":
                self.i += 1
                break
            lo = self.class_atom()
            if isinstance(lo, tuple):
                ranges += lo[1]
                continue
            if self.peek() == "-" and self.peek(2) not in ("-]", "-") and self.i + 1 < len(self.body):
                self.i += 1
                hi = self.class_atom()
                if isinstance(hi, tuple) or hi < lo:
                    raise self.error("a character range out of order or ending in a class escape")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        if not ranges:
            raise self.error("an empty character class, which matches nothing")
        return _negated(tuple(ranges)) if negated else _positive(tuple(ranges))

    def class_atom(self):
        if self.peek() == "\\":
            return self.class_escape()
        c = self.body[self.i]
        self.i += 1
        return ord(c)


def _merge(ranges) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _class_text(ranges) -> str:
    return "".join(_class_char(chr(lo)) if lo == hi else f"{_class_char(chr(lo))}-{_class_char(chr(hi))}"
                   for lo, hi in ranges)


def _negated(ranges) -> str:
    """A class of everything outside ``ranges`` that a JSON string may hold unescaped."""
    return f"[^{_class_text(_merge(tuple(ranges) + _JSON_ESCAPED))}]"


def _escaped(code: int) -> str:
    """The JSON escape for ``code`` (a character a JSON string must escape), as pattern text."""
    short = _SHORT_ESCAPES.get(code)
    second = f"[{_class_char(short)}]" if short in ('"', "\\") else short or f"u{code:04x}"
    return f"([\\x5C]{second})"


def _positive(ranges) -> str:
    """A class of ``ranges``, as JSON text: characters a JSON string must escape come out as their escapes."""
    merged = _merge(ranges)
    special = [c for lo, hi in merged for c in range(lo, min(hi, 0x5C) + 1) if c <= 0x1F or c in (0x22, 0x5C)]
    plain = merged
    for a, b in _JSON_ESCAPED:
        plain = [p for x, y in plain for p in ((x, min(y, a - 1)), (max(x, b + 1), y)) if p[0] <= p[1]]
    alternatives = ([f"[{_class_text(plain)}]"] if plain else []) + [_escaped(c) for c in special]
    return alternatives[0] if len(alternatives) == 1 else "(" + "|".join(alternatives) + ")"


def _literal(c: str) -> str:
    """One pattern character as converter input that writes it as JSON text."""
    code = ord(c)
    if c in _SAFE_LITERAL or (code >= 0x80 and code not in (0x2028, 0x2029)):
        return c
    if code <= 0x1F or code in (0x22, 0x5C):
        return _escaped(code)
    return f"[{_class_char(c)}]"


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
            alts = [f"[{_class_char(c)}] ({strings(node[c])})" if any(node[c]) else f"[{_class_char(c)}] {plain}+"
                    for c in chars]
            alts.append(f'[^"\\\\\\x7F\\x00-\\x1F{"".join(_class_char(c) for c in chars)}] {plain}*')
            body = " | ".join(alts)
            return body if "" in node else f"( {body} )?"

        return f'"\\"" {strings(trie)} "\\"" space'


def int_range_gbnf(lo: int | None, hi: int | None) -> str:
    """GBNF for the JSON integers in [lo, hi] (None: unbounded), at most 16 digits, as llama.cpp's C++
    ``build_min_max_int``, except that its recursion on a lower bound keeps the digits' width (llama.cpp's
    ``stoll(min_s.substr(1))`` drops the zeros, so its ``minimum: 100`` admits 10)."""
    cap = 10 ** _INTEGRAL_DIGITS - 1
    if hi is not None and hi >= cap:
        hi = None
    if lo is not None and lo <= -cap:
        lo = None
    if lo is None and hi is None:
        return '"-"? ([0] | [1-9] [0-9]{0,15})'
    # why: a one-sided bound of 15+ digits has no room for the longer numbers its single-bound rule writes
    if hi is None and lo >= 10 ** (_INTEGRAL_DIGITS - 2):
        hi = cap
    if lo is None and hi <= -10 ** (_INTEGRAL_DIGITS - 2):
        lo = -cap
    out: list[str] = []
    _min_max_int(lo, hi, out)
    return "".join(out)


def _digits(lo: int, hi: int | None, out: list[str]) -> None:
    out.append("[" + (str(lo) if lo == hi else f"{lo}-{hi}") + "]")


def _more_digits(lo: int, hi: int, out: list[str]) -> None:
    out.append("[0-9]" + ("" if lo == hi == 1 else "{%d}" % lo if lo == hi else "{%d,%d}" % (lo, hi)))


def _min_max_int(lo: int | None, hi: int | None, out: list[str]) -> None:
    less = _INTEGRAL_DIGITS - 1
    if lo is not None and hi is not None:
        if lo < 0 and hi < 0:
            out.append('"-" (')
            _min_max_int(-hi, -lo, out)
            out.append(")")
            return
        if lo < 0:
            out.append('"-" (')
            _min_max_int(0, -lo, out)
            out.append(") | ")
            lo = 0
        low, high = str(lo), str(hi)
        for n_digits in range(len(low), len(high)):
            _uniform_range(low, "9" * n_digits, out)
            low = "1" + "0" * n_digits
            out.append(" | ")
        _uniform_range(low, high, out)
    elif lo is not None:
        if lo < 0:
            out.append('"-" (')
            _min_max_int(0, -lo, out)
            out.append(") | [0] | [1-9] ")
            _more_digits(0, less, out)
        else:
            _at_least(str(lo), _INTEGRAL_DIGITS, True, out)
    elif hi >= 0:
        out.append('"-" [1-9] ')
        _more_digits(0, less, out)
        out.append(" | ")
        _min_max_int(0, hi, out)
    else:
        out.append('"-" (')
        _at_least(str(-hi), _INTEGRAL_DIGITS, True, out)
        out.append(")")


def _at_least(low: str, n_left: int, top: bool, out: list[str]) -> None:
    """Digit strings >= ``low`` taken as numbers of ``low``'s width or longer (top: with no leading zero, i.e.
    the integers >= low), at most ``n_left`` digits."""
    less = max(n_left - 1, 1)
    first = "1" if top else "0"
    if top and low == "0":
        out.append("[0] | [1-9] ")
        _more_digits(0, less, out)
        return
    if not top and not low.strip("0"):
        _more_digits(len(low), n_left, out)
        return
    c = int(low[0])
    if c > int(first):
        _digits(int(first), c - 1, out)
        out.append(" ")
        _more_digits(len(low), less, out)
        out.append(" | ")
    if len(low) == 1:
        _digits(c, 9, out)
        out.append(" ")
        _more_digits(0, less, out)
        return
    _digits(c, c, out)
    out.append(" (")
    _at_least(low[1:], less, False, out)
    out.append(")")
    if c < 9:
        out.append(" | ")
        _digits(c + 1, 9, out)
        out.append(" ")
        _more_digits(len(low) - 1, less, out)


def _uniform_range(low: str, high: str, out: list[str]) -> None:
    """The digit strings from ``low`` to ``high``, of the same length (llama.cpp's ``uniform_range``)."""
    i = 0
    while i < len(low) and low[i] == high[i]:
        i += 1
    if i > 0:
        out.append(f'"{low[:i]}"')
    if i == len(low):
        return
    if i > 0:
        out.append(" ")
    n_rest = len(low) - i - 1
    if n_rest == 0:
        out.append(f"[{low[i]}-{high[i]}]")
        return
    low_rest, high_rest = low[i + 1:], high[i + 1:]
    zeros, nines = "0" * n_rest, "9" * n_rest
    a, b = int(low[i]), int(high[i])
    reached = False
    out.append("(")
    if low_rest == zeros:
        _digits(a, b - 1, out)
        out.append(" ")
        _more_digits(n_rest, n_rest, out)
    else:
        out.append(f"[{a}] (")
        _uniform_range(low_rest, nines, out)
        out.append(")")
        if a < b - 1:
            out.append(" | ")
            if high_rest == nines:
                _digits(a + 1, b, out)
                reached = True
            else:
                _digits(a + 1, b - 1, out)
            out.append(" ")
            _more_digits(n_rest, n_rest, out)
    if not reached:
        out.append(" | ")
        _digits(b, b, out)
        out.append(" ")
        _uniform_range(zeros, high_rest, out)
    out.append(")")


__all__ = ["MAX_REPEAT", "check_schema", "int_range_gbnf", "json_object_grammar", "json_schema_grammar",
           "tool_grammar", "trigger_patterns"]
