"""From prompts to a training batch: generate, decode and score here (the sampling, with dynamic sampling's refills
and a rollout worker's share), then the batch's parts (grpo.training.rollout.assembly: advantages, padded tensors,
routes, samples) and its metrics (grpo.training.rollout.metrics); the records: grpo.training.rollout.batch.

Shapes: B prompts per step, G completions per prompt, N = B*G / processes rows on this process, P prompt
width (left-padded), T completion width (right-padded). Batches stay on the CPU; the update moves each micro-batch
to the model's device.
"""

from __future__ import annotations

import time

import torch

from grpo.agents.episodes import EpisodeRollout, one_row_each
from grpo.agents.metrics import agent_metrics
from grpo.engines.base import SamplingParams, row_seed
from grpo.engines.vllm_server import ServersDown
from grpo.training.data.vision import check_image_tokens_masked
from grpo.training.rollout.assembly import (outcome_advantages, rollout_routes, rollout_tensors, sample_rows,
                                            step_advantages)
from grpo.training.rollout.batch import RolloutBatch, SampleRequest, Sampled, as_completion, pad_rows, strip_eos
from grpo.training.rollout.metrics import reward_logs, rollout_metrics
from grpo.training.run.faults import engine_faults
from grpo.training.setup.processes import Processes


class Rollouts:
    """One step's rollout on this process: G completions per prompt from the rollout engine, decoded and scored,
    then group advantages (and process-supervision advantages) and padded tensors. `make(step)` returns the batch
    without old/reference log-probs, which the trainer adds."""

    def __init__(self, cfg, generator, policy, tokenizer, train_set, prompts, rewards, step_rewards,
                 procs: Processes, B: int, G: int, params: SamplingParams, agent=None):
        self.cfg, self.generator, self.policy, self.tokenizer, self.params = cfg, generator, policy, tokenizer, params
        self.agent = agent  # multi-turn rollouts over the generator (grpo.agents), or None
        self.train_set, self.prompts, self.rewards, self.step_rewards = train_set, prompts, rewards, step_rewards
        self.procs, self.B, self.G = procs, B, G
        self.eos_ids = {tokenizer.eos_token_id}
        self.times: dict[str, float] = {}
        self.engine_stale = False  # the trainer sets it after an optimizer step: the engine's weights are older
        self.trainer_state = None  # the trainer's transformers.TrainerState, passed to reward functions
        self._logged_metrics: dict[str, list[float]] = {}  # from reward functions' log_metric
        self._logged_columns: dict[str, list] = {}  # from reward functions' log_extra

    def _extras(self) -> dict:
        """TRL's reward-function extras: the trainer's state and the two logging callbacks."""
        def log_extra(column: str, values: list) -> None:
            self._logged_columns.setdefault(column, []).extend(values)

        def log_metric(name: str, value: float) -> None:
            self._logged_metrics.setdefault(name, []).append(float(value))

        return {"trainer_state": self.trainer_state, "log_extra": log_extra, "log_metric": log_metric}

    def ready_engine(self) -> None:
        """Hand the rollout engine the policy's weights if an optimizer step changed them, and wake it (a sleeping
        vLLM engine loads them as it wakes, between taking back its weights' memory and its KV cache's)."""
        if self.engine_stale:
            self.generator.update_weights(self.policy)
            self.engine_stale = False
        self.generator.wake()

    def _begin(self) -> None:
        self.times = {"generation": 0.0, "scoring": 0.0}
        self._logged_metrics, self._logged_columns = {}, {}

    def make(self, index: int) -> RolloutBatch:
        """Rollout `index` of the run."""
        self._begin()
        self.ready_engine()
        drawn = self.prompts.state_dict()
        try:
            if self.cfg.dynamic_sampling:
                sampled, sampling_metrics = self._sample_dynamic(index)
            else:
                sampled, sampling_metrics = self._sample(self.prompts.next(self.B), index), {}
        except ServersDown:  # (the run stops with a checkpoint of its last step: this rollout's prompts come next)
            self.prompts.load_state_dict(drawn)
            raise
        self.generator.sleep()  # (vLLM's sleep mode: its memory is the update's until the next rollout)
        return self.finish(sampled, sampling_metrics, index)

    def finish(self, sampled: Sampled, sampling_metrics: dict[str, float], index: int) -> RolloutBatch:
        """The training batch of rollout `index` from its scored completions (collective on several processes)."""
        batch = self._assemble(sampled)
        batch.metrics.update(sampling_metrics)
        batch.metrics.update(reward_logs(self.procs, self._logged_metrics))
        if self.cfg.dataset_on_bad_row == "skip":
            batch.metrics["data/skipped_rows"] = float(self.train_set.skipped)
        servers = getattr(self.generator, "servers_up", None)  # (a fleet of vLLM servers: grpo.engines.vllm_fleet)
        if servers is not None:
            batch.metrics["fleet/servers_up"] = float(servers)
        batch.index = index
        return batch

    def sample_request(self, request: SampleRequest | int) -> tuple[Sampled, dict]:
        """A rollout worker's part (grpo.training.rollout.pipeline): one request generated and scored, with what reward
        functions logged and the times, which `take_logs` hands to the trainer's `finish`. With dynamic sampling
        the request is the rollout's index: its prompts, refills included, are drawn here from this copy's prompt
        stream, and the logs carry the sampling metrics and the stream's state after the draw."""
        self._begin()
        self.ready_engine()
        if isinstance(request, int):
            sampled, sampling = self._sample_dynamic(request)
            extra = {"sampling": sampling, "prompts": self.prompts.state_dict()}
        else:
            sampled, extra = self._generate(request), {}
        self.generator.sleep()
        return sampled, {"metrics": self._logged_metrics, "columns": self._logged_columns, "times": self.times,
                         **extra}

    def take_logs(self, logs: dict) -> None:
        """What `sample_request` logged in a worker, as if this process had scored the rollout."""
        self._logged_metrics, self._logged_columns, self.times = logs["metrics"], logs["columns"], logs["times"]

    def _sample(self, prompts_idx: list[int], index: int, round_: int = 0) -> Sampled:
        """Generate G completions for each prompt (this process's share of the rows) and score them."""
        return self._generate(self.request(prompts_idx, index, round_))

    def request(self, prompts_idx: list[int], index: int, round_: int = 0) -> SampleRequest:
        """This process's share of the rows of the prompts `prompts_idx` (G each), and their seeds."""
        G, world, rank = self.G, self.procs.world, self.procs.rank
        n_local = len(prompts_idx) * G // world
        first = rank * n_local
        rows = [i for i in prompts_idx for _ in range(G)][first:first + n_local]
        prompts, prompt_ids, columns = self.train_set.rows(rows)
        # Seeds belong to rows; a dynamic-sampling refill round gets rows of its own.
        seeds = [row_seed(self.cfg.seed, index, first + r + round_ * 1_000_000) for r in range(n_local)]
        return SampleRequest(prompts, prompt_ids, columns, seeds, rows)

    def _generate(self, request: SampleRequest) -> Sampled:
        prompts, prompt_ids, columns, seeds = request.prompts, request.prompt_ids, request.columns, request.seeds
        t0 = time.perf_counter()
        agent = None
        images = (self.train_set.pixels(request.rows) if getattr(self.train_set, "images", None) is not None
                  else None)
        with engine_faults(self.cfg, "generation"):  # (out of memory, a dead vLLM: an error naming the setting)
            if images is not None:  # (each row's pixels go with it: grpo.training.data.vision)
                out = self.generator.generate(prompt_ids, self.params, seeds, images=images)
            elif self.agent is None:
                # (a server engine sends every process's rows in one request, all processes calling at once)
                out = self.generator.generate_together(prompt_ids, self.params, seeds)
            else:  # tools, environments or a rollout_func: the prompts may come back extended
                out = agent = self.agent.generate(prompts, prompt_ids, columns, self.params, seeds)
        if agent is not None:
            prompts, prompt_ids, columns = agent.prompts, agent.prompt_ids, {**columns, **agent.columns}
        t1 = time.perf_counter()
        texts = self.tokenizer.batch_decode([strip_eos(c, self.eos_ids) for c in out.ids], skip_special_tokens=False)
        completions = ([as_completion(p, t) for p, t in zip(prompts, texts)] if agent is None or
                       agent.completions is None else agent.completions)
        scored = self.rewards(prompts, completions, out.ids, columns, extras=self._extras())
        self.times["generation"] += t1 - t0
        self.times["scoring"] += time.perf_counter() - t1
        return Sampled(prompts, prompt_ids, columns, out.ids, out.truncated, texts, completions, scored.total,
                       scored.per_func, scored.errors, scored.timeouts, out.logprobs,
                       *((agent.model_mask, agent.stats) if agent is not None else ()), images=images,
                       extra_rows=getattr(agent, "extra_rows", None),
                       # (a user's engine's completions may carry no routes)
                       routes=getattr(out, "routes", None) if agent is None else None)

    def _sample_dynamic(self, index: int) -> tuple[Sampled, dict[str, float]]:
        """DAPO dynamic sampling: drop groups whose rewards are all equal, sample more prompts until the step has
        prompts_per_step groups or max_generation_rounds is reached (then it trains on the groups it has)."""
        G, kept, dropped, rounds, last = self.G, [], 0, 0, None
        while sum(len(k.total) for k in kept) < self.B * G and rounds < self.cfg.max_generation_rounds:
            last = self._sample(self.prompts.next(self.B), index, rounds)
            rounds += 1
            rewards = torch.tensor(last.total).view(-1, G)
            varied = [g for g in range(rewards.shape[0]) if float(rewards[g].max() - rewards[g].min()) > 0]
            dropped += rewards.shape[0] - len(varied)
            kept.append(last.select([g * G + j for g in varied for j in range(G)]))
        groups = sum(len(k.total) for k in kept) // G
        # No group with signal at all: train on the last round as it is (its advantages are zero).
        sampled = Sampled.concat(kept).select(list(range(min(groups, self.B) * G))) if groups else last
        return sampled, {"sampling/dropped_groups": float(dropped), "sampling/generation_rounds": float(rounds),
                         "sampling/kept_groups": float(min(groups, self.B))}

    def _assemble(self, s: Sampled) -> RolloutBatch:
        """Advantages and padding: the training batch of the sampled groups (grpo.training.rollout.assembly)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        rewards, outcome = outcome_advantages(cfg, self.procs, s, self.rewards, self.G)
        if self.procs.world > 1 and isinstance(self.agent, EpisodeRollout):
            one_row_each(self.procs, s.extra_rows)  # (collective)
        input_ids, attention, cmask = rollout_tensors(s, cfg.mask_truncated_completions, self.tokenizer.pad_token_id)
        if s.extra_rows:  # an episode's calls that did not extend its first row: rows of their own, its advantage
            outcome = torch.cat([outcome, outcome[[e[0] for e in s.extra_rows]]])
        advantages, step_metrics = outcome, {}
        if self.step_rewards:
            ids = [strip_eos(c, self.eos_ids) for c in s.completion_ids]
            advantages, step_metrics = step_advantages(cfg, self.procs, self.tokenizer, self.step_rewards, self.G, s,
                                                       ids, outcome, cmask)
        batch = RolloutBatch(input_ids, attention, cmask, advantages, images=s.images)
        if s.images is not None:
            check_image_tokens_masked(input_ids, cmask, self.policy.config.image_token_id)
        if s.logprobs is not None:
            batch.sampling_logp = pad_rows(s.logprobs + [e[4] for e in s.extra_rows or []], cmask.shape[1])
        batch.routes = rollout_routes(s, attention, cmask)
        self.times["scoring"] += time.perf_counter() - t0
        batch.metrics = {**rollout_metrics(s, rewards, outcome, self.procs.gather), **step_metrics}
        if s.agent_stats is not None:
            batch.metrics.update(agent_metrics(s.agent_stats, s.model_mask, self.procs.gather))
        batch.samples = sample_rows(s, outcome, self._logged_columns, cfg.log_unique_prompts)
        return batch
