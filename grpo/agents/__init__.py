"""Agents: multi-turn rollouts in which the model calls tools or acts in environments; only its own tokens train.

- `tools.py`: tools are plain functions, described by transformers' `get_json_schema`; built-ins `calculator`, `python`
- `parsing.py`: the model's `<tool_call>` blocks (Hermes / Qwen2.5 format)
- `worker.py`: tool calls in forked worker processes with deadlines
- `environments.py`: `environment_factory` (TRL 1.16's shape)
- `template.py`: tool answers as the chat template renders them, appended token-exactly
- `loop.py`: the multi-turn loop over any rollout engine; `custom.py`: a user's `rollout_func`
- `endpoint.py` (`api.py`): an OpenAI-compatible endpoint on the rollout engine; `recording.py`: its calls,
  token-exact, and the training rows made of them; `episodes.py`: a user's `episode(client, row)` as the rollout;
  `processes.py`: those episodes in worker processes of their own (`Episodes(..., processes=N)`)
- `spec.py`: what a run's rollouts use, settled before the model loads

See docs/agents.md.
"""

from __future__ import annotations

from grpo.agents.endpoint import Endpoint
from grpo.agents.episodes import Episodes
from grpo.agents.loop import AgentRollout, Trajectories, turn_seed
from grpo.agents.spec import AgentSpec, make_agent_spec
from grpo.agents.tools import BUILTIN_TOOLS, ToolError, calculator

__all__ = ["AgentRollout", "AgentSpec", "BUILTIN_TOOLS", "Endpoint", "Episodes", "ToolError", "Trajectories",
           "calculator",
           "make_agent_spec", "make_rollout", "turn_seed"]


def make_rollout(spec: AgentSpec, trainer):
    """The multi-turn rollout of a trainer's run: `spec`'s tools over its rollout engine, prompts an environment
    extends rendered as its training prompts are; or the user's rollout_func, which is handed the trainer."""
    if isinstance(spec.rollout_func, Episodes):  # an agent's episodes through the endpoint
        return spec.rollout_func.rollout(trainer.generator, trainer.tokenizer, trainer.params,
                                         trainer.cfg.model_name_or_path, trainer.accel.autocast,
                                         trainer.cfg.max_completion_length)
    if spec.rollout_func is not None:
        from grpo.agents.custom import CustomRollout

        return CustomRollout(spec.rollout_func, trainer, trainer.tokenizer)
    return AgentRollout(spec, trainer.generator, trainer.tokenizer, trainer.train_set.render,
                        trainer.cfg.max_completion_length)
