"""Tools: plain Python functions the model calls, described to it by the JSON schema transformers builds.

A tool is a function with type hints and a Google-style docstring (an `Args:` section), as transformers' chat
templates take them: `transformers.utils.get_json_schema(function)` gives the schema that the chat template renders
into the prompt, and the same schema checks each call's arguments here. In a recipe a tool is a built-in name
(`calculator`, `python`) or a `module:function` path.

Built-ins:
  calculator(expression)  exact arithmetic with + - * / ** and parentheses (`grpo.rewards.safe_math`, never eval)
  python(code)            runs the code in the local sandbox (`grpo.rewards.sandbox`) and returns its output
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from grpo.agents.parsing import ToolCall
from grpo.config import ConfigError

# Kinds of tool errors, as counted in the metrics (tools/errors/<kind>).
ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")


class ToolError(ConfigError):
    """A tool that cannot be used: not importable, not callable, or without the schema a chat template needs."""


@dataclass
class Tool:
    name: str
    function: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters", ...}}
    in_process: bool = False  # an environment's method: runs here, on its instance (see grpo.agents.environments)


def make_tool(function: Callable, in_process: bool = False) -> Tool:
    """A `Tool` from a function (or a bound method), its schema from its type hints and docstring."""
    from transformers.utils import get_json_schema

    if not callable(function):
        raise ToolError(f"tools: {function!r} is not callable.")
    name = getattr(function, "__name__", type(function).__name__)
    try:
        schema = get_json_schema(function)
    except Exception as err:  # noqa: BLE001 - transformers raises its own exception classes for each problem
        raise ToolError(f"tools: cannot describe {name!r} to the model ({err}). A tool needs type hints on every "
                        "argument and a docstring with an Args: section that describes each one.") from None
    return Tool(name, function, schema, in_process)


def resolve_tool(spec) -> Tool:
    """A built-in tool name, a "module:function" path, or a callable."""
    if callable(spec):
        return make_tool(spec)
    if not isinstance(spec, str):
        raise ToolError(f"tools: {spec!r} is neither a tool name, a 'module:function' path nor a function.")
    if spec in BUILTIN_TOOLS:
        return make_tool(BUILTIN_TOOLS[spec])
    if ":" not in spec:
        raise ToolError(f"tools: unknown tool {spec!r}; built-in tools are {', '.join(BUILTIN_TOOLS)}, or give a "
                        "'module:function' path.")
    return make_tool(import_object(spec, "tools"))


def import_object(path: str, key: str):
    """The object a "module:attribute" path names; a ToolError naming `key` if it cannot be imported."""
    module_name, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ToolError(f"{key}: cannot import {path!r} ({type(err).__name__}: {err}).") from None


class ToolSet:
    """The tools one trajectory may call, by name."""

    def __init__(self, tools: list[Tool]):
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            names = [t.name for t in tools]
            raise ToolError(f"tools: two tools are named {sorted({n for n in names if names.count(n) > 1})}; "
                            "tool names must be unique.")

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def check(self, call: ToolCall) -> tuple[str, str] | None:
        """None for a call that can run; else (error kind, the message the model is answered with)."""
        if call.error is not None:
            return "malformed", f"Error: {call.error}."
        if call.name not in self.tools:
            available = ", ".join(self.tools) or "none"
            return "unknown_tool", f"Error: there is no tool named {call.name!r} (tools: {available})."
        problem = argument_problem(self.tools[call.name].schema["function"].get("parameters", {}), call.arguments)
        if problem is not None:
            return "bad_arguments", f"Error: {call.name}: {problem}."
        return None


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def argument_problem(parameters: dict, arguments: dict) -> str | None:
    """What is wrong with `arguments` for a JSON-schema `parameters` object, or None: a missing required argument,
    an unknown one, a value of the wrong JSON type, or one outside an enum."""
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        return f"missing required argument {missing[0]!r}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"unexpected argument {unknown[0]!r} (arguments: {', '.join(properties) or 'none'})"
    for name, value in arguments.items():
        problem = _value_problem(properties[name], value)
        if problem is not None:
            return f"argument {name!r} {problem}"
    return None


def _value_problem(schema: dict, value) -> str | None:
    if value is None and schema.get("nullable"):
        return None
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
    known = [k for k in kinds if k in _JSON_TYPES]
    # bool is an int in Python; JSON true is not an integer
    if known and not any(isinstance(value, _JSON_TYPES[k]) and not (isinstance(value, bool) and k in
                                                                    ("integer", "number")) for k in known):
        return f"must be {' or '.join(known)}, got {type(value).__name__} {value!r}"[:200]
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']}, got {value!r}"[:200]
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            problem = _value_problem(schema["items"], item)
            if problem is not None:
                return f"has an item that {problem}"
    return None


def clip(text: str, max_chars: int) -> str:
    """`text`, cut to `max_chars` characters with a note saying how much was left out."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [{len(text) - max_chars} more characters]"


def as_text(value) -> str:
    """A tool's return value as the tool message's text."""
    return value if isinstance(value, str) else str(value)


# ---- built-in tools ------------------------------------------------------------------------------------------------
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers with + - * / ** and parentheses, e.g. "482 * 37".
    """
    from grpo.rewards.safe_math import safe_eval

    value = safe_eval(expression)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator} = {float(value):.12g}"


def python(code: str) -> str:
    """Run a Python program (standard library only) and return what it printed.

    Args:
        code: The program; print the values you need.
    """
    from grpo.rewards.sandbox import run_sandboxed

    result = run_sandboxed(code, timeout_s=5.0)
    out = result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")
    return out if result.status == "ok" else f"{result.status}: {out or result.detail}"


BUILTIN_TOOLS: dict[str, Callable] = {"calculator": calculator, "python": python}
