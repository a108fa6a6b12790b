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
