"""What a run would use, before it runs: `grpo train RECIPE key=value --print-config` (or `--help-config`, with each
key's meaning) prints the resolved config as YAML, one key per entry in the dataclass's order, and marks each value
that differs from grpo's default (`GRPOConfig()`) or from TRL 1.16's. The output is a valid recipe: saved to a file,
`grpo train` runs it. Lines are wrapped to the terminal's width (the meanings as `#` comments above their key).
docs/config.md is the Markdown reference of the same keys (grpo.config.reference).
"""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
from typing import Any

import yaml

from grpo.config.presets import PRESETS
from grpo.config.schema import GRPOConfig
from grpo.config.trl_fields import settings
from grpo.config.trl_keys import TABLE


def trl_defaults() -> dict[str, Any]:
    """TRL 1.16's default of every key of ours that TRL's GRPOConfig (or TrainingArguments, ModelConfig, ...) has."""
    out = {row.name: row.default for row in TABLE
           if row.kind == "field" and row.source not in ("open-r1", "legacy", "trainer")}
    out.update({key: value for key, value in PRESETS["trl"].items() if key in out or key in
                ("task", "use_chat_template", "max_prompt_length", "eval_on_start")})
    out["output_dir"] = "trainer_output"
    return out


def _dump(key: str, value: Any, width: int) -> str:
    try:
        text = yaml.safe_dump(value, default_flow_style=True, width=width - len(key) - 2).strip()
    except yaml.YAMLError:  # (an object given through the Python API: shown, not loadable)
        return f"{key}: {value!r}"
    return f"{key}: " + text.removesuffix("\n...").replace("\n", "\n  ")  # (a value's next lines: indented)


def _short(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...")
    return text if len(text) <= 40 else text[:37] + "..."


def resolved_yaml(cfg: GRPOConfig, explain: bool, title: str = "", width: int | None = None) -> str:
    """`cfg` as YAML: each value that differs from grpo's default or TRL's marked in a comment beside it; with
    `explain`, each key's meaning as wrapped comment lines above it."""
    width = width or max(60, min(120, shutil.get_terminal_size((100, 24)).columns))
    trl = trl_defaults()
    marks = ("`# grpo default: X` marks a value that differs from GRPOConfig()'s, `# TRL: Y` one that differs from "
             "TRL 1.16's.")
    lines = [f"# {line}" for line in [*textwrap.wrap(title, width - 2), *textwrap.wrap(
        f"The resolved config: what this run would use. {marks}", width - 2)]]
    for f in settings(GRPOConfig):
        value = getattr(cfg, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        notes = []
        if value != default:
            notes.append(f"grpo default: {_short(default)}")
        if f.name in trl and value != trl[f.name]:
            notes.append(f"TRL: {_short(trl[f.name])}")
        if explain:
            help_text = f.metadata.get("help", "")
            if "choices" in f.metadata:
                help_text += " One of: " + ", ".join(map(str, f.metadata["choices"])) + "."
            lines.append("")
            lines += [f"# {line}" for line in textwrap.wrap(help_text, width - 2)]
        entry = _dump(f.name, value, width)
        if notes:
            comment = "  # " + "; ".join(notes)
            fits = "\n" not in entry and len(entry) + len(comment) <= width
            entry = entry + comment if fits else comment.strip() + "\n" + entry  # (above a long or folded value)
        lines.append(entry)
    return "\n".join(lines) + "\n"
