"""What the trainer and its forked rollout worker say to each other over their pipe (grpo.training.rollout.pipeline),
one record per kind, pickled whole. In order on the pipe: the worker applies `Weights` and answers each `Generate`
with the weights last applied, so a request names the version it must be sampled with and the worker checks it.

    trainer -> worker   Weights(version, tensors)   the trainable weights after optimizer step `version`
                        Generate(index, version, request)   rollout `index` (a SampleRequest, or with dynamic
                                                    sampling the index alone: the worker draws the prompts)
                        Stop()                      (also what the worker reads when the pipe closes)
    worker -> trainer   Answer(index, sampled, logs, info)  the Sampled fields, what reward functions logged,
                                                    and the version, idle time and reference log-probs
                        Failure(index, traceback)   the worker's error; it exits after sending it
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.training.rollout.batch import SampleRequest


@dataclass(frozen=True)
class Weights:
    version: int
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Generate:
    index: int
    version: int
    request: SampleRequest | int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Answer:
    index: int
    sampled: dict[str, Any]  # vars(Sampled)
    logs: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    index: int | None
    traceback: str
