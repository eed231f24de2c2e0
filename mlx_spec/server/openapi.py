"""/openapi.json: the endpoints and their request bodies as JSON Schema, written by hand from
protocol.py, anthropic.py and responses.py (keep them together: tests/test_server_fuzz.py
generates its requests from this document, and checks that the server accepts what it
describes).

The bounds are the ones protocol.py enforces; a body outside them is answered 400 (never 5xx).
"""

from __future__ import annotations

from .protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_TEMPLATE_STRING,
    MAX_TOP_LOGPROBS,
    PENALTY_CONTEXT_MAX,
    ROLES,
)

INT32 = 2**31 - 1
TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "a JSON object, as text"},
            },
        },
    },
}
CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}
MESSAGE = {
    "anyOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": sorted(ROLES - {"assistant", "tool"})},
                "content": CONTENT,
                "name": {"type": "string"},
            },
        },
        {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"const": "assistant"},
                "content": {
                    "anyOf": [*CONTENT["anyOf"], {"type": "null"}],
                    "description": "null: a message that only calls tools",
                },
                "name": {"type": "string"},
                "tool_calls": {"type": "array", "items": TOOL_CALL},
                "reasoning_content": {"type": "string"},
            },
        },
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"const": "tool"},
                "content": CONTENT,
                "tool_call_id": {"type": "string"},
            },
        },
    ]
}
TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "parameters": {"type": "object"},
            },
        },
    },
}
STOP = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
        {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
    ]
}
RESPONSE_FORMAT = {
    "anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {
                        "name": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"type": "boolean"},
                        "description": {"type": "string"},
                    },
                },
            },
        },
    ]
}
COMMON = {
    "model": {"type": "string", "minLength": 1, "description": "a pair name (GET /v1/models)"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": INT32},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0},
    "stop": STOP,
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
        "description": "only with stream: true",
    },
    "user": {"type": "string"},
    "n": {"const": 1},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 0, "maximum": 10},
    "presence_context_size": {"type": "integer", "minimum": 0, "maximum": PENALTY_CONTEXT_MAX},
    "frequency_context_size": {"type": "integer", "minimum": 0, "maximum": PENALTY_CONTEXT_MAX},
    "repetition_context_size": {"type": "integer", "minimum": 0, "maximum": PENALTY_CONTEXT_MAX},
    "logit_bias": {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id (as a string, below the vocabulary size) -> bias",
    },
    "response_format": RESPONSE_FORMAT,
}
CHAT_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **COMMON,
        "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "tools": {"type": "array", "items": TOOL},
        "tool_choice": {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string"}},
                        },
                    },
                },
            ]
        },
        "parallel_tool_calls": {"type": "boolean"},
        "chat_template_kwargs": {
            "type": "object",
            "additionalProperties": {
                "anyOf": [
                    {"type": "string", "maxLength": MAX_TEMPLATE_STRING},
                    {"type": "number"},
                    {"type": "boolean"},
                    {"type": "null"},
                ]
            },
            "description": "variables for the model's chat template (e.g. enable_thinking)",
        },
    },
}
COMPLETION_REQUEST = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **COMMON,
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            ]
        },
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
        "echo": {"const": False},
        "best_of": {"const": 1},
        "suffix": {"const": ""},
    },
}
# ------------------------------------------------------------------ Anthropic's Messages
TEXT_BLOCK = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "type": {"const": "text"},
        "text": {"type": "string"},
        "cache_control": {"type": "object", "description": "accepted, ignored"},
    },
}
BLOCKS = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_BLOCK}]}
TOOL_USE = {
    "type": "object",
    "required": ["type", "id", "name", "input"],
    "properties": {
        "type": {"const": "tool_use"},
        "id": {"type": "string"},
        "name": {"type": "string"},
        "input": {"type": "object"},
    },
}
TOOL_RESULT = {
    "type": "object",
    "required": ["type", "tool_use_id"],
    "properties": {
        "type": {"const": "tool_result"},
        "tool_use_id": {"type": "string"},
        "content": BLOCKS,
        "is_error": {"type": "boolean"},
    },
}
THINKING_BLOCK = {
    "type": "object",
    "required": ["type", "thinking"],
    "properties": {
        "type": {"const": "thinking"},
        "thinking": {"type": "string"},
        "signature": {"type": "string"},
    },
}
ANTHROPIC_MESSAGE = {
    "anyOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"const": "user"},
                "content": {
                    "anyOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"anyOf": [TEXT_BLOCK, TOOL_RESULT]}},
                    ]
                },
            },
        },
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"const": "assistant"},
                "content": {
                    "anyOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {"anyOf": [TEXT_BLOCK, TOOL_USE, THINKING_BLOCK]},
                        },
                    ]
                },
            },
        },
    ]
}
MESSAGES_FIELDS = {
    "model": COMMON["model"],
    "system": BLOCKS,
    "messages": {"type": "array", "minItems": 1, "items": ANTHROPIC_MESSAGE},
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "required": ["name", "input_schema"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "input_schema": {"type": "object"},
            },
        },
    },
    "tool_choice": {
        "anyOf": [
            {
                "type": "object",
                "required": ["type"],
                "properties": {"type": {"enum": ["auto", "any", "none"]}},
            },
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {"type": {"const": "tool"}, "name": {"type": "string"}},
            },
        ]
    },
    "thinking": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": ["enabled", "disabled", "adaptive"]},
            "budget_tokens": {"type": "integer", "description": "accepted, not used"},
        },
        "description": "the chat template's enable_thinking, where it has one",
    },
    "metadata": {"type": "object", "description": "accepted, ignored"},
}
MESSAGES_REQUEST = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        **MESSAGES_FIELDS,
        "max_tokens": COMMON["max_tokens"],
        "stop_sequences": {"type": "array", "items": STOP["anyOf"][0]},
        "temperature": COMMON["temperature"],
        "top_p": COMMON["top_p"],
        "top_k": COMMON["top_k"],
        "stream": COMMON["stream"],
    },
}
COUNT_TOKENS_REQUEST = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": MESSAGES_FIELDS,
}
# ------------------------------------------------------------------ OpenAI's Responses
INPUT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
}
INPUT_ITEM = {
    "anyOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "system", "developer", "assistant"]},
                "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": INPUT_PART}]},
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "name", "arguments"],
            "properties": {
                "type": {"const": "function_call"},
                "call_id": {"type": "string"},
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "a JSON object, as text"},
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "output"],
            "properties": {
                "type": {"const": "function_call_output"},
                "call_id": {"type": "string"},
                "output": {"type": "string"},
            },
        },
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"const": "reasoning"}, "summary": {"type": "array"}},
        },
    ]
}
RESPONSES_REQUEST = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": COMMON["model"],
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": INPUT_ITEM}]},
        "instructions": {"type": "string"},
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"const": "function"},
                    "name": {"type": "string", "minLength": 1},
                    "description": {"type": "string"},
                    "parameters": {"type": "object"},
                    "strict": {"type": "boolean"},
                },
            },
        },
        "tool_choice": {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "name"],
                    "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
                },
            ]
        },
        "max_output_tokens": COMMON["max_tokens"],
        "temperature": COMMON["temperature"],
        "top_p": COMMON["top_p"],
        "stream": COMMON["stream"],
        "text": {
            "type": "object",
            "properties": {
                "format": {
                    "anyOf": [
                        {
                            "type": "object",
                            "required": ["type"],
                            "properties": {"type": {"enum": ["text", "json_object"]}},
                        },
                        {
                            "type": "object",
                            "required": ["type", "schema"],
                            "properties": {
                                "type": {"const": "json_schema"},
                                "name": {"type": "string"},
                                "schema": {"type": "object"},
                                "strict": {"type": "boolean"},
                            },
                        },
                    ]
                }
            },
        },
        "reasoning": {
            "type": "object",
            "properties": {
                "effort": {"enum": ["none", "minimal", "low", "medium", "high"]},
            },
            "description": "the chat template's enable_thinking (off for none, minimal)",
        },
        "previous_response_id": {"type": "string"},
        "store": {"type": "boolean"},
        "parallel_tool_calls": {"type": "boolean"},
        "prompt_cache_key": {"type": "string", "description": "accepted, ignored"},
        "include": {"type": "array", "items": {"type": "string"}},
        "metadata": {"type": "object"},
        "user": {"type": "string"},
        "truncation": {"enum": ["auto", "disabled"]},
    },
}
ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def operation(summary: str, body: dict | None = None, stream: bool = False) -> dict:
    responses = {
        "200": {"description": "the answer"},
        "4XX": {
            "description": "the request is refused",
            "content": {"application/json": {"schema": ERROR}},
        },
    }
    if stream:
        responses["200"]["content"] = {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        }
    op = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
    return op


def document(version: str = "") -> dict:
    """The OpenAPI 3.1 document of this server."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "mlx-spec serve", "version": version or "0"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "ChatCompletionRequest": CHAT_REQUEST,
                "CompletionRequest": COMPLETION_REQUEST,
                "MessagesRequest": MESSAGES_REQUEST,
                "CountTokensRequest": COUNT_TOKENS_REQUEST,
                "ResponsesRequest": RESPONSES_REQUEST,
                "Error": ERROR,
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {
                "post": operation("Chat completion", CHAT_REQUEST, stream=True)
            },
            "/v1/completions": {"post": operation("Text completion", COMPLETION_REQUEST, True)},
            "/v1/messages": {
                "post": operation(
                    "Anthropic Messages (x-api-key or Bearer)", MESSAGES_REQUEST, True
                )
            },
            "/v1/messages/count_tokens": {
                "post": operation("Anthropic count_tokens: {input_tokens}", COUNT_TOKENS_REQUEST)
            },
            "/v1/responses": {"post": operation("OpenAI Responses", RESPONSES_REQUEST, True)},
            "/v1/responses/{id}": {"get": operation("A stored response (its own key only)")},
            "/v1/models": {"get": operation("The served pair and those it may swap to")},
            "/": {
                "get": {
                    **operation("ok: the server answers (Claude Code's preconnect)"),
                    "security": [],
                }
            },
            "/health": {"get": {**operation("ok, or 503 once the engine died"), "security": []}},
            "/metrics": {"get": operation("Prometheus text: a key's own figures, or all")},
            "/openapi.json": {"get": {**operation("This document"), "security": []}},
        },
    }
