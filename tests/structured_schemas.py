"""Five JSON schemas of the shapes structured output must hold (nested objects, arrays, enums, optional
fields, bounded numbers), for ``test_serve_clients_real`` and ``benchmarks/structured_output.py``.  Free text
is bounded (``maxLength``): a grammar keeps a string well-formed, not short, and at temperature 1.0 a small
model can write one past any ``max_tokens``."""
SCHEMAS = {
    "nested order": {
        "type": "object", "additionalProperties": False, "required": ["id", "customer", "shipping"],
        "properties": {
            "id": {"type": "string", "maxLength": 60},
            "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email"],
                         "properties": {"name": {"type": "string", "maxLength": 60}, "email": {"type": "string", "maxLength": 60}}},
            "shipping": {"type": "object", "additionalProperties": False, "required": ["address"],
                         "properties": {"address": {"type": "object", "additionalProperties": False,
                                                    "required": ["street", "city"],
                                                    "properties": {"street": {"type": "string", "maxLength": 60},
                                                                   "city": {"type": "string", "maxLength": 60}}}}}}},
    "shopping list": {
        "type": "object", "additionalProperties": False, "required": ["items"],
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 5,
                                 "items": {"type": "object", "additionalProperties": False,
                                           "required": ["name", "quantity"],
                                           "properties": {"name": {"type": "string", "maxLength": 60},
                                                          "quantity": {"type": "integer"}}}}}},
    "support ticket": {
        "type": "object", "additionalProperties": False, "required": ["title", "priority", "status"],
        "properties": {"title": {"type": "string", "maxLength": 60},
                       "priority": {"enum": ["low", "medium", "high"]},
                       "status": {"type": "string", "enum": ["open", "closed"]}}},
    "user profile": {
        "type": "object", "additionalProperties": False, "required": ["username"],
        "properties": {"username": {"type": "string", "maxLength": 60},
                       "nickname": {"anyOf": [{"type": "string", "maxLength": 60}, {"type": "null"}]},
                       "bio": {"type": "string", "maxLength": 60}, "verified": {"type": "boolean"}}},
    "thermostat setting": {
        "type": "object", "additionalProperties": False, "required": ["room", "celsius", "fan_speed"],
        "properties": {"room": {"type": "string", "maxLength": 60},
                       "celsius": {"type": "integer", "minimum": 5, "maximum": 30},
                       "fan_speed": {"type": "integer", "minimum": 0, "maximum": 3},
                       "minutes": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1440}}},
}

# the other schemas the suite sends (the clients' tests, test_serve_clients; the grammar's, test_grammar) and shapes
# a converter finds hard (refs, recursion, unions, integer ranges, patterns, formats): for the grammar oracle
# (test_grammar_oracle), not for sampling at temperature 1 (unbounded, a small model may write them forever)
MORE_SCHEMAS = {**SCHEMAS, **{
    "person name (clients, strict)": {"type": "object", "properties": {"name": {"type": "string"}},
                                      "required": ["name"], "additionalProperties": False},
    "city (the openai SDK's parse)": {
        "type": "object", "additionalProperties": False, "required": ["name", "population", "tags"],
        "properties": {"name": {"type": "string"}, "population": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string"}}}},
    "summary (clients)": {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"],
                          "additionalProperties": False},
    "two fields (cut by max_tokens)": {"type": "object", "properties": {"a": {"type": "string"},
                                                                        "b": {"type": "integer"}},
                                       "required": ["a", "b"]},
    "an integer range (llama-server's json_schema)": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 12}}, "required": ["n"]},
    "refs with clashing names and a recursive tree": {
        "$defs": {"string": {"type": "integer"}, "value": {"const": 7},
                  "tree": {"type": "object", "properties": {"kids": {"type": "array",
                                                                      "items": {"$ref": "#/$defs/tree"}}}}},
        "type": "object", "required": ["string", "v"],
        "properties": {"string": {"$ref": "#/$defs/string"}, "v": {"$ref": "#/$defs/value"},
                       "tree": {"$ref": "#/$defs/tree"}}},
    "a discriminated union (pydantic)": {
        "$defs": {"Cat": {"type": "object", "required": ["pet_type", "meows"],
                          "properties": {"pet_type": {"const": "cat"}, "meows": {"type": "integer"}}},
                  "Dog": {"type": "object", "required": ["pet_type", "barks"],
                          "properties": {"pet_type": {"const": "dog"}, "barks": {"type": "number"}}}},
        "type": "object", "required": ["pet"],
        "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                               "discriminator": {"propertyName": "pet_type"}},
                       "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}}},
    "bounded arrays, enums and negative ranges": {
        "type": "object", "required": ["scores", "kind", "t"],
        "properties": {"scores": {"type": "array", "minItems": 2, "maxItems": 4,
                                  "items": {"type": "integer", "minimum": -105, "maximum": 250}},
                       "kind": {"enum": ["a", "b", 3, None]}, "t": {"type": "integer", "exclusiveMaximum": -99}}},
    "patterns, lengths and formats": {
        "type": "object", "required": ["zip", "code", "day"],
        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                       "code": {"type": "string", "minLength": 3, "maxLength": 5},
                       "day": {"type": "string", "format": "date"}}},
    "any JSON value": {},
    "an array at the top": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}}}},
}}
