"""Request fields -> one output constraint (:class:`StructuredOutputs`), checked and compiled before
the request reaches the engine, so a bad schema is a 400 that names the problem.

Accepted constraints (at most one per request):

* ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` or
  ``{"type": "structural_tag", "format": {...}}`` (xgrammar's structural tag);
* extensions (vLLM/SGLang style): ``regex``, ``choice`` (list of strings), ``grammar`` (EBNF);
* forced tool calls: ``tool_choice: "required"`` or a named function, constrained to the tool
  parser's call format with each tool's parameter schema.
"""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from tokenmill.contracts.sampling import StructuredOutputs
from tokenmill.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from tokenmill.server.common import ServerState

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def check_json_schema(schema: Any, param: str) -> None:
    """400 unless ``schema`` is a JSON schema (an object valid under the JSON Schema metaschema)."""
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object, got {type(schema).__name__}", param,
                          code="invalid_schema")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise bad_request(f"{param} is not a valid JSON schema: {e.message}" + (f" (at {where})" if where else ""),
                          param, code="invalid_schema") from None


def response_format_constraint(fmt: Any, param: str = "response_format") -> StructuredOutputs | None:
    """The constraint asked for by an OpenAI ``response_format`` (or Responses ``text.format``)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"{param} must be an object with a 'type'", param)
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"{param}.type must be one of {', '.join(map(repr, RESPONSE_FORMAT_TYPES))}, "
                          f"got {kind!r}", f"{param}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "structural_tag":
        tag = fmt.get("format")
        if not isinstance(tag, dict):
            raise bad_request(f"{param}.format must be an object (an xgrammar structural tag format)",
                              f"{param}.format")
        return StructuredOutputs("structural_tag", json.dumps({"type": "structural_tag", "format": tag}))
    # json_schema: Chat Completions nests it under "json_schema"; Responses puts it inline
    spec = fmt.get("json_schema", fmt)
    where = f"{param}.json_schema" if "json_schema" in fmt else param
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with a 'schema'", where)
    schema = spec.get("schema")
    if schema is None:
        raise bad_request(f"{where}.schema is required for a json_schema response format", f"{where}.schema",
                          code="missing_required_parameter")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
    check_json_schema(schema, f"{where}.schema")
    return StructuredOutputs.json(schema)


def extension_constraints(req: Any) -> list[tuple[str, StructuredOutputs]]:
    """The ``regex`` / ``choice`` / ``grammar`` extension fields that are set, as constraints."""
    found: list[tuple[str, StructuredOutputs]] = []
    if req.regex is not None:
        if not req.regex:
            raise bad_request("regex must not be empty", "regex")
        found.append(("regex", StructuredOutputs("regex", req.regex)))
    if req.choice is not None:
        if not req.choice or any(not c for c in req.choice):
            raise bad_request("choice must be a non-empty list of non-empty strings", "choice")
        found.append(("choice", StructuredOutputs.choice(req.choice)))
    if req.grammar is not None:
        if not req.grammar.strip():
            raise bad_request("grammar must not be empty", "grammar")
        found.append(("grammar", StructuredOutputs("grammar", req.grammar)))
    return found


def single_constraint(found: list[tuple[str, StructuredOutputs]]) -> StructuredOutputs | None:
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one output constraint may be given per request, got {len(found)}: {names}",
                          found[1][0], code="conflicting_constraints")
    return found[0][1] if found else None


async def compiled(state: ServerState, spec: StructuredOutputs | None, param: str) -> None:
    """Compile ``spec`` (cached per spec, on the compiler's worker thread); a 400 if it is invalid."""
    if spec is None:
        return
    from tokenmill.engine.structured import GrammarError

    compiler = await state.grammar_compiler()
    try:
        await asyncio.wrap_future(compiler.compile(spec))
    except GrammarError as e:
        raise bad_request(str(e), param, code="invalid_" + ("schema" if spec.kind.startswith("json") else spec.kind)) \
            from None
    except Exception as e:  # noqa: BLE001
        raise APIError(500, f"grammar compilation failed: {e}", type="server_error", code="grammar_error") from None


def tool_call_constraint(parser: Any, tools: list[tuple[str, Any]], *, name: str | None, parallel: bool,
                         param: str = "tools") -> StructuredOutputs:
    """Constraint forcing calls of ``tools`` ((name, parameters schema) pairs; only ``name`` when
    given) in ``parser``'s format; each parameters schema is checked first (400 naming the tool)."""
    chosen: list[tuple[str, dict[str, Any] | None]] = []
    for i, (tool_name, schema) in enumerate(tools):
        if schema is not None:
            check_json_schema(schema, f"{param}.{i}.parameters")
        if name is None or tool_name == name:
            chosen.append((tool_name, schema))
    return parser.call_constraint(chosen, parallel=parallel)
