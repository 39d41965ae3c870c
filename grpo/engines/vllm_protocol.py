"""The bodies of `grpo vllm-serve`'s JSON endpoints as typed records (grpo.engines.vllm_server has the protocol's
table). The trainer builds them; the server reads a body with `from_json`, which names a missing field and the
endpoint instead of failing with a KeyError inside a handler. Standard library and torch only: a trainer needs no
vLLM."""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass

import torch

from grpo.engines.base import Completions, SamplingParams


def _require(body: dict, endpoint: str, *names: str) -> None:
    missing = [name for name in names if name not in body]
    if missing:
        raise ValueError(f"{endpoint}: the body lacks {', '.join(missing)} (a trainer of another grpo version? "
                         f"upgrade the server and the trainers together)")


@dataclass(frozen=True)
class Part:
    """One trainer process's part of a request that several send separately: the rollout's key, how many
    processes send, which one this is, and how long the server waits for the others (its `Together`)."""

    key: str
    parts: int
    part: int
    timeout: float | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """POST /generate: the rows' prompt ids, the sampling settings, one seed per row (None: the engine's own
    stream), the EOS ids, the optimizer step whose weights must sample them (None: whatever the server holds), and
    the part this is of a request several processes send (None: the whole request), and whether the reply
    carries an MoE's routes (the server's engine must record them: /health's `routes`)."""

    prompt_ids: list[list[int]]
    params: SamplingParams
    seeds: list[int] | None
    eos_ids: list[int]
    step: int | None = None
    together: Part | None = None
    routes: bool = False

    def to_dict(self) -> dict:
        body = {"prompt_ids": self.prompt_ids, "params": dataclasses.asdict(self.params), "seeds": self.seeds,
                "eos_ids": list(self.eos_ids)}
        if self.step is not None:
            body["step"] = self.step
        if self.together is not None:
            body["together"] = dataclasses.asdict(self.together)
        if self.routes:
            body["routes"] = True
        return body

    @classmethod
    def from_json(cls, body: dict) -> GenerateRequest:
        _require(body, "/generate", "prompt_ids", "params", "seeds", "eos_ids")
        together = body.get("together")
        if together:
            _require(together, "/generate's together", "key", "parts", "part")
            together = Part(str(together["key"]), int(together["parts"]), int(together["part"]),
                            together.get("timeout"))
        return cls(body["prompt_ids"], SamplingParams(**body["params"]), body["seeds"], body["eos_ids"],
                   body.get("step"), together or None, bool(body.get("routes", False)))

    @staticmethod
    def merged(parts: list[GenerateRequest]) -> GenerateRequest:
        """The parts' rows as one request (their settings are the first's: every process sends the same)."""
        first = parts[0]
        seeds = None if first.seeds is None else [seed for p in parts for seed in p.seeds]
        return dataclasses.replace(first, prompt_ids=[r for p in parts for r in p.prompt_ids], seeds=seeds,
                                   together=None)


@dataclass(frozen=True)
class GenerateReply:
    """/generate's answer: the completions and the step of the weights that sampled them (None: a push that named
    no step). An MoE's routes (Completions.routes: (tokens, layers, k) uint8 per row) travel as each row's bytes in
    base64 (`routes`) and their `route_shape` (layers, k): 4/3 of a byte per token, layer and chosen expert."""

    completions: Completions
    policy_step: int | None

    def to_dict(self) -> dict:
        out = self.completions
        body = {"ids": out.ids, "truncated": out.truncated, "logprobs": out.logprobs, "policy_step": self.policy_step}
        if out.routes is not None:
            body["routes"] = [base64.b64encode(r.contiguous().numpy().tobytes()).decode() for r in out.routes]
            body["route_shape"] = list(out.routes[0].shape[1:]) if out.routes else []
        return body

    @classmethod
    def from_json(cls, body: dict) -> GenerateReply:
        _require(body, "/generate's reply", "ids", "truncated")
        routes = body.get("routes")
        if routes is not None:
            shape = body["route_shape"]
            routes = [torch.frombuffer(bytearray(base64.b64decode(r)), dtype=torch.uint8).reshape(-1, *shape)
                      for r in routes]
        return cls(Completions(body["ids"], body["truncated"], body.get("logprobs"), routes), body.get("policy_step"))

    def split(self, sizes: list[int]) -> list[GenerateReply]:
        """The reply cut into consecutive parts of `sizes` rows (a merged request's answer, part by part)."""
        out, start = [], 0
        for size in sizes:
            rows = {f.name: getattr(self.completions, f.name) for f in dataclasses.fields(Completions)}
            part = {k: v[start:start + size] if isinstance(v, list) else v for k, v in rows.items()}
            out.append(GenerateReply(Completions(**part), self.policy_step))
            start += size
        return out


@dataclass(frozen=True)
class CommunicatorRequest:
    """POST /init_communicator: where the trainer's rank 0 of the two-rank weight group listens, its backend, and
    the group's timeout in seconds."""

    host: str
    port: int
    backend: str
    timeout: float

    @classmethod
    def from_json(cls, body: dict) -> CommunicatorRequest:
        _require(body, "/init_communicator", "host", "port", "backend", "timeout")
        return cls(body["host"], int(body["port"]), body["backend"], float(body["timeout"]))
