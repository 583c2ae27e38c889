"""Structured outputs on the default model (SmolLM2-135M-Instruct from its GGUF, real loader):
50 prompts, ten for each of the 5 schemas, sent concurrently through the openai client; every
output must parse and validate with jsonschema. The same server (started without --tool-call-parser) answers forced
tool calls in the default hermes format."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import openai

from tokenmill.loader.resolve import DEFAULT_MODEL
from tokenmill.utils.proc import ServiceProcess

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {"type": "object", "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False},
            "home": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["person", "home"], "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                       "ok": {"type": "boolean"}},
        "required": ["color", "size", "ok"], "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                  "minItems": 1, "maxItems": 4},
                       "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs"]}, "maxItems": 3}},
        "required": ["scores", "labels"], "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"celsius": {"type": "integer", "minimum": -50, "maximum": 50},
                       "count": {"type": "integer", "minimum": 1, "maximum": 10},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["celsius", "count", "ratio"], "additionalProperties": False,
    },
    "required": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                       "title": {"type": "string", "minLength": 1, "maxLength": 16},
                       "done": {"type": "boolean"},
                       "note": {"type": "string", "maxLength": 8}},
        "required": ["id", "title", "done"], "additionalProperties": False,
    },
}

TOOL = {"type": "function", "function": {"name": "lookup", "description": "look a topic up", "parameters": {
    "type": "object", "properties": {"topic": {"type": "string", "maxLength": 24},
                                     "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["topic", "limit"], "additionalProperties": False}}}

TOPICS = ["a baker", "a pilot", "a cat", "a chess club", "a bug report", "the weather", "a bicycle", "a lighthouse",
          "a coffee order", "a library", "a rocket launch", "a garden", "a train ride", "a football match",
          "a pizza", "a violin", "a hospital visit", "a mountain hike", "a code review", "a birthday party"]
VERBS = ["Describe", "Summarise", "Give facts about", "Report on", "Invent data for"]


def _prompts() -> list[str]:
    out = [f"{VERBS[i % len(VERBS)]} {TOPICS[i % len(TOPICS)]} (case {i}) as JSON." for i in range(50)]
    assert len(set(out)) == 50
    return out


def test_50_prompts_over_5_schemas_all_validate(tmp_path: Path) -> None:
    argv = ["serve", "--model", DEFAULT_MODEL, "--max-model-len", "2048", "--kv-cache-tokens", "16384",
            "--max-running-requests", "64"]
    with ServiceProcess(argv, log_path=tmp_path / "server.log", start_timeout=300) as proc:
        client = openai.AsyncOpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)

        async def one(prompt: str, name: str) -> tuple[str, str, str, str | None]:
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
            r = await client.chat.completions.create(
                model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=96, temperature=0,
                response_format=fmt)
            return prompt, name, r.choices[0].message.content or "", r.choices[0].finish_reason

        async def call(prompt: str) -> openai.types.chat.ChatCompletion:
            return await client.chat.completions.create(
                model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=96, temperature=0,
                tools=[TOOL], tool_choice="required")

        async def run() -> tuple[list[tuple[str, str, str, str | None]], list[openai.types.chat.ChatCompletion]]:
            try:
                calls = asyncio.gather(*(call(p) for p in _prompts()[:5]))
                names = list(SCHEMAS)
                return (await asyncio.gather(*(one(p, names[i % len(names)]) for i, p in enumerate(_prompts()))),
                        await calls)
            finally:
                await client.close()

        results, tool_results = asyncio.run(run())
    for r in tool_results:
        assert r.choices[0].finish_reason == "tool_calls", r
        for c in r.choices[0].message.tool_calls:
            assert c.function.name == "lookup"
            jsonschema.validate(json.loads(c.function.arguments), TOOL["function"]["parameters"])
    assert len(results) == 50 and {name for _, name, _, _ in results} == set(SCHEMAS)
    failures = []
    for prompt, name, text, finish in results:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append((name, prompt, finish, text, str(e)[:120]))
    assert not failures, f"{len(failures)}/50 outputs did not validate, e.g. {failures[:3]}"
