"""Reward functions for GRPO, in TRL's protocol: `f(prompts, completions, completion_ids, **columns)` returns one
`float | None` per completion (None: "does not apply to this sample"). Functions written for TRL or open-r1 run
unchanged, and every built-in accepts plain-string and conversational (message-list) completions.

Built-ins (each a reward function as it stands; the parameterized ones also configure: `countdown.configure(
exact_use=True)` or `Countdown(exact_use=True)`, or from a config `{"name": "countdown", "exact_use": true}`):
    think_format, tag_count, reasoning_steps     format of the completion (seeds; open-r1)
    r1_format                                    open-r1's exact format_reward (its name `format`)
    countdown / Countdown                        equation from given numbers to a target (seeds, TinyZero)
    math_accuracy / MathAccuracy                 final answer vs gold, math-verify in a killable worker
    cosine_length / CosineLength                 length-scaled accuracy (open-r1)
    repetition_penalty / RepetitionPenalty       n-gram repetition (open-r1)
    soft_overlong / SoftOverlong                 DAPO overlong punishment on token counts (TRL)
    RewardModel                                  a sequence-classification checkpoint, scores logits[:, 0]
    LLMJudge (llm_judge)                         a model behind an OpenAI-compatible server grades each completion
    RemoteRewardModel (remote_rm)                a reward server in OpenRLHF's remote_rm_url protocol
Step rewards (process supervision) return per completion a list of (end char offset, score):
    arithmetic_steps / ArithmeticSteps           each `a op b = c` line checked exactly
"""

from .base import ConfigurableReward
from .coding import Code, code, code_syntax
from .countdown import Countdown, countdown
from .judge import LLMJudge
from .format import r1_format, reasoning_steps, tag_count, think_format
from .math_accuracy import MathAccuracy, math_accuracy
from .registry import ALIASES, BUILTINS, STEP_BUILTINS, get_reward_funcs, resolve_reward, resolve_step_reward
from .remote import RemoteRewardModel
from .reward_model import RewardModel
from .runner import RewardError, RewardOutput, RewardRunner, RewardUnavailable, column_requirements
from .shaping import CosineLength, RepetitionPenalty, SoftOverlong, cosine_length, repetition_penalty, soft_overlong
from .steps import ArithmeticSteps, arithmetic_steps

__all__ = [
    "get_reward_funcs",
    "Code",
    "code",
    "code_syntax",
    "ALIASES",
    "BUILTINS",
    "STEP_BUILTINS",
    "ArithmeticSteps",
    "ConfigurableReward",
    "CosineLength",
    "Countdown",
    "LLMJudge",
    "MathAccuracy",
    "RemoteRewardModel",
    "RepetitionPenalty",
    "RewardError",
    "RewardModel",
    "RewardOutput",
    "RewardRunner",
    "RewardUnavailable",
    "SoftOverlong",
    "arithmetic_steps",
    "column_requirements",
    "cosine_length",
    "countdown",
    "math_accuracy",
    "reasoning_steps",
    "repetition_penalty",
    "resolve_reward",
    "resolve_step_reward",
    "soft_overlong",
    "tag_count",
    "think_format",
    "r1_format",
]
