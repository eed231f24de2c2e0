"""Five JSON Schemas of different shapes (and an instance of each), shared by the structured-
output benchmarks: a flat object, nested arrays, enums, long free text, numbers and nesting."""

from __future__ import annotations

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "born": {"type": "integer"},
            "died": {"type": "integer"},
            "nationality": {"type": "string"},
            "occupation": {"type": "string"},
        },
        "required": ["name", "born", "died", "nationality", "occupation"],
        "additionalProperties": False,
    },
    "nested_arrays": {
        "type": "object",
        "properties": {
            "team": {"type": "string"},
            "members": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "roles": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                    },
                    "required": ["name", "roles"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["team", "members"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "language": {"enum": ["python", "javascript", "rust", "go", "haskell"]},
            "paradigm": {"enum": ["functional", "object-oriented", "procedural", "logic"]},
            "typing": {"enum": ["static", "dynamic", "gradual"]},
            "garbage_collected": {"type": "boolean"},
            "first_release": {"type": "integer"},
        },
        "required": ["language", "paradigm", "typing", "garbage_collected", "first_release"],
        "additionalProperties": False,
    },
    "long_text": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "summary": {"type": "string", "minLength": 200},
            "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        },
        "required": ["title", "summary", "keywords"],
        "additionalProperties": False,
    },
    "numbers_nested": {
        "type": "object",
        "properties": {
            "product": {"type": "string"},
            "price": {"type": "number"},
            "in_stock": {"type": "boolean"},
            "dimensions": {
                "type": "object",
                "properties": {
                    "width_cm": {"type": "number"},
                    "height_cm": {"type": "number"},
                    "depth_cm": {"type": "number"},
                },
                "required": ["width_cm", "height_cm", "depth_cm"],
                "additionalProperties": False,
            },
        },
        "required": ["product", "price", "in_stock", "dimensions"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "flat": "Give the facts about Ada Lovelace as JSON.",
    "nested_arrays": "Describe the Apollo 11 crew as a team, as JSON.",
    "enums": "Describe the Python programming language as JSON.",
    "long_text": "Summarize the story of Romeo and Juliet as JSON.",
    "numbers_nested": "Describe a wooden bookshelf for sale as JSON.",
}

INSTANCES = {
    "flat": {
        "name": "Ada Lovelace",
        "born": 1815,
        "died": 1852,
        "nationality": "British",
        "occupation": "Mathematician and writer",
    },
    "nested_arrays": {
        "team": "Apollo 11",
        "members": [
            {"name": "Neil Armstrong", "roles": ["Commander"]},
            {"name": "Buzz Aldrin", "roles": ["Lunar Module Pilot"]},
            {"name": "Michael Collins", "roles": ["Command Module Pilot"]},
        ],
    },
    "enums": {
        "language": "python",
        "paradigm": "object-oriented",
        "typing": "dynamic",
        "garbage_collected": True,
        "first_release": 1991,
    },
    "long_text": {
        "title": "Romeo and Juliet",
        "summary": "Two young lovers from feuding families in Verona meet at a feast, marry in "
        "secret and are separated when Romeo kills Juliet's cousin and is banished. A plan to "
        "reunite them fails, and both die, which finally reconciles their families.",
        "keywords": ["tragedy", "love", "feud"],
    },
    "numbers_nested": {
        "product": "Oak bookshelf",
        "price": 149.99,
        "in_stock": True,
        "dimensions": {"width_cm": 80.0, "height_cm": 180.5, "depth_cm": 30.0},
    },
}

# features beyond the five shapes: which engine compiles which
COVERAGE = {
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
        "required": ["code"],
    },  # noqa: E501
    "format date-time": {
        "type": "object",
        "properties": {"at": {"type": "string", "format": "date-time"}},
        "required": ["at"],
    },  # noqa: E501
    "anyOf": {
        "anyOf": [
            {"type": "integer"},
            {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
        ]
    },  # noqa: E501
    "$ref recursion": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["value"],
            }
        },
        "$ref": "#/$defs/node",
    },  # noqa: E501
    "minItems/maxItems": {
        "type": "array",
        "items": {"type": "integer"},
        "minItems": 2,
        "maxItems": 4,
    },  # noqa: E501
    "string length": {"type": "string", "minLength": 3, "maxLength": 10},
    "integer range": {"type": "integer", "minimum": 10, "maximum": 99},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},  # noqa: E501
}
