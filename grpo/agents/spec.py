"""What a run's rollouts may use beyond the model, settled before the model loads: its tools, its environments,
or a rollout function of the user's; and the checks that need no model.

`make_agent_spec` takes the trainer's arguments (TRL's `tools`, `environment_factory`, `rollout_func`) or, when they
are not given, the config's keys of the same names (import paths), then the task's tools; the config's `agent` (an
episode function's path) becomes `Episodes(episode)`. The tool worker processes
are forked here, while the process is still small (grpo.agents.worker).
"""

from __future__ import annotations

import inspect
import os
from typing import Callable

from grpo.agents.environments import COLUMN, Environments
from grpo.agents.template import ToolTemplate
from grpo.agents.tools import Tool, ToolError, ToolSet, import_object, resolve_tool
from grpo.config import ConfigError


class AgentSpec:
    def __init__(self, tools: list[Tool], environments: Environments | None, rollout_func: Callable | None,
                 max_iterations: int | None = None, timeout_s: float = 10.0, max_chars: int = 2000):
        self.tools, self.environments, self.rollout_func = tools, environments, rollout_func
        self.max_iterations, self.timeout_s, self.max_chars = max_iterations, timeout_s, max_chars
        ToolSet(tools)  # (unique names)
        self.workers = None
        if tools:
            from grpo.agents.worker import ToolWorkers

            self.workers = ToolWorkers({t.name: t.function for t in tools}, processes=min(4, os.cpu_count() or 1))

    def run_in_workers(self, calls: list[tuple[str, dict]]) -> list[tuple[str, str | None]]:
        return self.workers.run(calls, self.timeout_s, self.max_chars) if calls else []

    def needed_columns(self, columns: dict[str, list]) -> dict[str, list]:
        """The dataset columns the rollout itself reads, kept when `remove_unused_columns` drops the others: the
        `environment` column that picks each row's environment from a dict of factories."""
        if getattr(self.rollout_func, "reads_rows", False):  # an agent's episode gets its whole row
            return columns
        envs = self.environments
        return {COLUMN: columns[COLUMN]} if envs is not None and envs.multi and COLUMN in columns else {}

    def reward_funcs(self) -> list[tuple[str, Callable]]:
        """The environments' `get_reward`, or an agent's episode return, as extra reward functions (weight 1)."""
        if hasattr(self.rollout_func, "reward_funcs"):  # (grpo.agents.episodes.Episodes)
            return self.rollout_func.reward_funcs()
        return self.environments.reward_funcs() if self.environments is not None else []

    def reward_columns(self) -> list[str] | None:
        """Keywords the rollouts add for the reward functions, beside the dataset's columns; None when they are
        not known before the rollout (a rollout_func's own fields)."""
        if self.rollout_func is not None:
            return None
        return ["environments"] if self.environments is not None else []

    def prompt_tools(self, tokenizer) -> Callable[[dict, int], list]:
        """`schemas(columns, n)`, once the tokenizer's chat template is known to render tool calls (checked now,
        before the model loads, rather than at the first rollout)."""
        if self.rollout_func is None:
            ToolTemplate(tokenizer)
        return self.schemas

    def schemas(self, columns: dict[str, list], n: int) -> list[list[dict] | None]:
        """The tool schemas each of `n` rows' prompt is rendered with (None: no tools)."""
        if self.rollout_func is not None:
            return [None] * n
        if self.environments is None:
            return [[t.schema for t in self.tools] or None] * n
        names = self.environments.names(columns, n, known=False)
        return [[t.schema for t in self.tools] + self.environments.schemas.get(name, []) or None for name in names]

    def describe(self) -> str:
        """One line for the start of a run: what the rollouts may call, and their limits."""
        if self.rollout_func is not None:
            return f"rollout_func {getattr(self.rollout_func, '__name__', self.rollout_func)}"
        parts = []
        if self.tools:
            parts.append(f"tools {', '.join(t.name for t in self.tools)} (in {self.workers.processes} worker "
                         "processes)")
        if self.environments is not None:
            names = [getattr(f, "__name__", str(f)) for f in self.environments.factories.values()]
            parts.append(f"environments {', '.join(names)}")
        rounds = "no limit" if self.max_iterations is None else f"at most {self.max_iterations}"
        return "; ".join(parts) + f"; {rounds} rounds of calls, {self.timeout_s:g} s a call"

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


def _episodes(episode, settings: dict):
    """`Episodes(episode, **settings)` of the keys `agent` and `agent_kwargs`; a setting it lacks is named."""
    from grpo.agents.episodes import Episodes

    allowed = [name for name in inspect.signature(Episodes).parameters if name != "episode"]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ConfigError(f"agent_kwargs: {unknown[0]!r} is not a setting of an agent's episodes; they are "
                          f"{', '.join(allowed)} (docs/agents.md).")
    return Episodes(episode, **settings)


def make_agent_spec(cfg, tools=None, environment_factory=None, rollout_func=None, task=None,
                    accelerator=None) -> AgentSpec | None:
    """The run's AgentSpec, or None for single-turn rollouts. Raises ConfigError naming the key. Forks the tool
    worker processes: call it before the model loads."""
    task_tools = task.tools if task is not None and not cfg.agent else []  # (an agent brings its own tools)
    tools = list(tools) if tools is not None else list(cfg.tools or task_tools)
    factory = environment_factory if environment_factory is not None else _factories(cfg.environment_factory)
    rollout = rollout_func if rollout_func is not None else (
        import_object(cfg.rollout_func, "rollout_func") if cfg.rollout_func else None)
    if cfg.agent_kwargs and not cfg.agent:
        raise ConfigError("agent_kwargs: settings of an agent's episodes; name the episode function too (agent: "
                          "module:function).")
    if cfg.agent:
        if rollout is not None:
            raise ConfigError("agent: an agent's episodes are the rollout; give agent or rollout_func, not both.")
        rollout = _episodes(import_object(cfg.agent, "agent"), cfg.agent_kwargs or {})
    if not tools and factory is None and rollout is None:
        return None
    if rollout is not None and (tools or factory is not None):
        raise ConfigError("rollout_func: a rollout function of your own replaces the tool loop; give it, or tools / "
                          "environment_factory, not both.")
    if rollout is not None and not callable(rollout):
        raise ConfigError(f"rollout_func: {rollout!r} is not callable.")
    if cfg.step_reward_funcs:
        raise ConfigError("step_reward_funcs: process supervision is not built for multi-turn rollouts (tools, "
                          "environments, rollout_func); remove one of them.")
    episodes, several = getattr(rollout, "reads_rows", False), accelerator is not None and \
        accelerator.num_processes > 1
    if episodes and several and rollout.port:
        raise ConfigError(f"rollout_func: Episodes(port={rollout.port}) on {accelerator.num_processes} processes: "
                          "each process serves its own endpoint; leave port 0 (a free port each).")
    if (rollout is None or episodes) and several and _sharded(accelerator):
        raise ConfigError("tools: multi-turn rollouts with sharded weights (FSDP2, ZeRO-3) on several processes are "
                          "not built yet (each turn's generation is collective there, and processes take different "
                          "numbers of turns); use DDP or ZeRO-2, or a rollout_func.")
    resolved = [t if isinstance(t, Tool) else resolve_tool(t) for t in tools]
    environments = Environments(factory) if factory is not None else None
    return AgentSpec(resolved, environments, rollout, cfg.max_tool_calling_iterations, cfg.tool_timeout,
                     cfg.max_tool_output_chars)


def _sharded(accelerator) -> bool:
    """Whether accelerate shards the weights (FSDP2, DeepSpeed ZeRO-3), so that generation is collective."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return accelerator.distributed_type == "FSDP" or (accelerator.distributed_type == "DEEPSPEED"
                                                      and getattr(plugin, "zero_stage", None) == 3)


def _factories(spec):
    """The config's environment_factory: a "module:Class" path, or a map of them by environment name."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        return {name: import_object(path, f"environment_factory.{name}") for name, path in spec.items()}
    if isinstance(spec, str):
        return import_object(spec, "environment_factory")
    raise ToolError(f"environment_factory: expected a 'module:Class' path or a map of them, got {spec!r}.")
