"""Structured outputs as the APIs ask for them: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and a forced tool call (``tool_choice: "required"`` or a named function). Each becomes the
engine's `StructuredOutput` (engine/structured_output.py) and is compiled here once, so a spec that does
not compile is a 400 naming the field it came in, before the request reaches a worker."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput
from services.gateway.request_body import Body

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function that declares none takes {}
_JSON_OBJECT = {"type": "object"}  # OpenAI's json_object: any JSON object


class JsonSchemaFormat(Body):
    name: str
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema", description="The JSON Schema the answer keeps to.")
    description: str | None = None
    strict: bool | None = Field(None, description="Accepted either way: the answer always keeps to the schema.")


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self) -> StructuredOutput | None:
        self.check_extra("response_format")
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise InvalidRequestError("response_format", f"json_schema goes with type json_schema, not {self.type}")
            return None if self.type == "text" else StructuredOutput("json", json_spec(_JSON_OBJECT))
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError("response_format", "type json_schema needs json_schema.schema")
        self.json_schema.check_extra("response_format.json_schema")
        return StructuredOutput("json", json_spec(self.json_schema.schema_))


class StructuredOutputsParams(Body):
    """vLLM's ``structured_outputs``: one of json, regex, choice, grammar and json_object."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json", description="A JSON Schema (or its text).")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A Lark or GBNF (llama.cpp) grammar.")
    json_object: bool | None = None
    disable_any_whitespace: bool = Field(False, description="JSON without whitespace between its tokens.")

    def structured_output(self) -> StructuredOutput:
        self.check_extra("structured_outputs")
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", "give exactly one of json, regex, choice, grammar and "
                                                            f"json_object, got {len(given)}")
        if self.disable_any_whitespace and given[0] not in ("json_", "json_object"):
            raise InvalidRequestError("structured_outputs", "disable_any_whitespace only applies to json and "
                                                            "json_object")
        if given[0] == "json_object":
            return StructuredOutput("json", json_spec(_JSON_OBJECT, self.disable_any_whitespace))
        if given[0] == "json_":
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError("structured_outputs", f"json: not valid JSON: {exc}") from None
            return StructuredOutput("json", json_spec(schema, self.disable_any_whitespace))
        if given[0] == "choice":
            return StructuredOutput("choice", json.dumps(self.choice))
        return StructuredOutput(given[0], getattr(self, given[0]))


def json_spec(schema: Any, compact: bool = False) -> str:
    """A JSON schema's spec text; ``compact``: no whitespace between tokens (llguidance's own schema option)."""
    if schema is True:
        schema = {}
    if compact and isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), "whitespace_flexible": False}}
    return json.dumps(schema)


def requested_output(response_format: ResponseFormat | None, structured_outputs: StructuredOutputsParams | None,
                     forced_call: StructuredOutput | None = None) -> StructuredOutput | None:
    """The one structured output a request asks for, compiled; a 400 for two, or one that does not compile."""
    asked = {"response_format": response_format.structured_output() if response_format else None,
             "structured_outputs": structured_outputs.structured_output() if structured_outputs else None,
             "tool_choice": forced_call}
    given = [(param, spec) for param, spec in asked.items() if spec is not None]
    if len(given) > 1:
        raise InvalidRequestError(given[1][0], f"only one structured output per request: {given[0][0]} asks for one")
    if not given:
        return None
    param, spec = given[0]
    try:
        spec.validate()
    except InvalidRequestError as exc:
        raise InvalidRequestError(param, exc.message) from None
    return spec


def forced_call_output(tools: list[dict], name: str | None, single: bool = False) -> StructuredOutput:
    """What a forced tool call keeps to: the named function's arguments (``name``), or for ``tool_choice:
    "required"`` (``name`` None) a JSON list of one or more ``{"name", "parameters"}`` calls, as vLLM forces
    them (``single``: exactly one, for ``parallel_tool_calls: false``). A call object holds nothing else."""
    functions = {tool["function"]["name"]: tool["function"].get("parameters") or _EMPTY_PARAMETERS
                 for tool in tools}
    if name is not None:
        if name not in functions:
            raise InvalidRequestError("tool_choice", f"names the function {name!r}, which tools do not hold")
        return StructuredOutput("json", json_spec(functions[name]))
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
              "required": ["name", "parameters"], "additionalProperties": False} for n, p in functions.items()]
    listed = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({"maxItems": 1} if single else {})}
    return StructuredOutput("json", json_spec(listed))
