"""Structured output's request fields, checked before any rank sees them: `response_format`
(`text`, `json_object`, `json_schema`) and `grammar` (a Lark grammar, or a GBNF one, converted).
The grammar is compiled here against the served model's tokenizer, so a grammar the engine refuses
is a 400 naming the field and the engine's message (strata_dist/sampling/structured.py does the rest on the
last stage)."""
from __future__ import annotations

import json
from typing import Any

from protocol.messages import MAX_GRAMMAR_BYTES

from ..sampling.structured import ANY_OBJECT_SCHEMA, GrammarError, check_grammar
from ..gguf_file.tokenizer import GGUFTokenizer

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
SCHEMA_PARAM = "response_format.json_schema.schema"


class StructuredRequestError(ValueError):
    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def structured_grammar(body: dict, tok: GGUFTokenizer) -> tuple[str, str]:
    """The request's grammar as (kind, text) for `SamplingParams` (("", "") when it has none).
    Raises StructuredRequestError naming the field."""
    fmt = _response_format(body.get("response_format"))
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise StructuredRequestError("grammar", f"'grammar' must be a string (a Lark or GBNF "
                                                f"grammar), got {type(grammar).__name__}",
                                     "invalid_type")
    if grammar is not None and not grammar.strip():
        raise StructuredRequestError("grammar", "'grammar' is empty")
    if grammar is not None and fmt is not None:
        raise StructuredRequestError("grammar", "give either 'grammar' or a 'response_format' "
                                                "other than text, not both")
    if grammar is not None:
        kind, text, param = "lark", grammar, "grammar"
    elif fmt is not None:
        kind, text, param = "json_schema", fmt[0], fmt[1]
    else:
        return "", ""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise StructuredRequestError(param, f"'{param}' is {size} bytes; at most "
                                            f"{MAX_GRAMMAR_BYTES} are allowed")
    try:
        check_grammar(kind, text, tok)
    except GrammarError as e:
        raise StructuredRequestError(param, f"'{param}' is refused by the grammar engine: {e}",
                                     "invalid_grammar") from None
    return kind, text


def _response_format(rf: Any) -> tuple[str, str] | None:
    """The JSON schema text that `response_format` asks for and the field it came from, or None
    (plain text)."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise StructuredRequestError("response_format", f"'response_format' must be an object, "
                                                        f"got {type(rf).__name__}", "invalid_type")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMATS:
        raise StructuredRequestError("response_format.type",
                                     f"'response_format.type' must be one of "
                                     f"{', '.join(RESPONSE_FORMATS)}, got {_short(kind)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT_SCHEMA, "response_format"
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredRequestError("response_format.json_schema",
                                     "'response_format.json_schema' must be an object with the "
                                     "schema in 'schema'", "invalid_type")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise StructuredRequestError("response_format.json_schema.name",
                                     f"'response_format.json_schema.name' must be a string, got "
                                     f"{type(name).__name__}", "invalid_type")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredRequestError("response_format.json_schema.strict",
                                     f"'response_format.json_schema.strict' must be true or false, "
                                     f"got {_short(strict)}", "invalid_type")
    schema = spec.get("schema", {})   # no schema: any JSON value
    if not isinstance(schema, (dict, bool)):
        raise StructuredRequestError(SCHEMA_PARAM, f"'{SCHEMA_PARAM}' must be a JSON schema (an "
                                                   f"object or a boolean), got "
                                                   f"{type(schema).__name__}", "invalid_type")
    try:
        return json.dumps(schema, ensure_ascii=False), SCHEMA_PARAM
    except (ValueError, RecursionError):
        raise StructuredRequestError(SCHEMA_PARAM, f"'{SCHEMA_PARAM}' is nested too deeply") from None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 64 else text[:61] + "..."
