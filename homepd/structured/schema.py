"""What a JSON schema may be for structured output: ``canonical_schema`` reduces a schema to the form
llama.cpp's converter enforces, or refuses it (RequestError naming the JSON path and the keyword) where the
grammar would silently not enforce it; the limits are ``homepd.structured.limits``'.  Pure: the grammar is
written from the canonical form by ``homepd.llm.grammar``."""
from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from urllib.parse import unquote

from homepd.structured.pattern import PatternRegex
from homepd.structured.limits import (INTEGRAL_DIGITS, MAX_ONE_OF, MAX_PROPERTY_NAME, MAX_REPEAT, MAX_SCHEMA_CHARS,
                                      MAX_SCHEMA_DEPTH, MAX_SCHEMA_PROPERTIES, MAX_SCHEMA_VALUES, Budget)
from homepd.errors import RequestError

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
            return {"type": "string", "pattern": PatternRegex(pattern, _at(path, "pattern"), self.budget).convert()}
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
        limit = 10 ** INTEGRAL_DIGITS
        if (lo is not None and lo >= limit) or (hi is not None and hi <= -limit):
            raise RequestError(f"{path}: its bounds leave only integers of more than {INTEGRAL_DIGITS} digits, "
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
