"""The parts of TRL's `GRPOTrainer` that TRL users' code touches beyond train(): attributes (`args`, `accelerator`,
`state` with its setter, `ref_model`, `eval_dataset`, `reward_processing_classes`, `_logs`), the callback methods,
`evaluate(eval_dataset=)` with one dataset or a dict of them, TRL's two mask methods (the math is grpo.core.masks),
and the end-of-training summary transformers' Trainer appends to `state.log_history`.

TRL 1.16 (trl/trainer/grpo_trainer.py) and transformers' Trainer are the reference for names and meaning; TRL's own
test suite, adapted by scripts/adapt_trl_tests.py, checks them (docs/from_trl.md).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_pt_utils import log_metrics, metrics_format, save_metrics, save_state

from grpo.config.derived import needs_reference
from grpo.core import entropy_threshold, high_entropy_mask, off_policy_mask

_SENTINEL = -1e9  # entropies are >= 0: pads the gathered entropies across processes, then dropped


class TRLSurface:
    """Mixed into GRPOTrainer: TRL's attribute and method names over grpo's trainer."""

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether an MoE load-balancing loss is added (router_aux_loss_coef; grpo.engines.moe)."""
        routing = self.updates.routing
        return routing is not None and routing.coef != 0.0
    # transformers' Trainer's own: the "***** train metrics *****" print, {split}_results.json and all_results.json,
    # trainer_state.json in output_dir (open-r1's script calls all three after train())
    log_metrics, metrics_format, save_metrics, save_state = log_metrics, metrics_format, save_metrics, save_state

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def args(self):
        """The run's config (TRL: the GRPOConfig the trainer was given)."""
        return self.cfg

    @property
    def accelerator(self):
        return self.accel

    @accelerator.setter
    def accelerator(self, value) -> None:  # (TRL's tests and subclasses set it; the trainer then uses that one)
        self.accel = value

    @property
    def reward_func_names(self) -> list[str]:
        """TRL's name of each reward function (a function's name, a reward model's, an environment's class)."""
        return list(self.reward_names)

    @property
    def reward_funcs(self) -> list:
        """TRL's list of the reward functions (callables and loaded reward models), in reward_func_names' order."""
        return list(self.rewards.funcs)

    @property
    def tools(self) -> list:
        """TRL's list of the model's tools as callables: the tools given, then each environment's tool methods (the
        class's functions; rollouts bind them to their own instances)."""
        agents = getattr(self, "agents", None)
        if agents is None:
            return []
        found = [t.function for t in agents.tools]
        envs = agents.environments
        for name, factory in (envs.factories.items() if envs is not None else ()):
            owner = factory if isinstance(factory, type) else next(iter(envs.pool.get(name) or []), None)
            found += [getattr(owner, m) for m in envs.methods[name] if owner is not None]
        return found

    @property
    def reward_weights(self) -> torch.Tensor:
        """TRL's float32 tensor of the reward functions' weights, in reward_func_names' order."""
        return torch.tensor([float(w) for w in self.rewards.weights[:len(self.reward_names)]], dtype=torch.float32)

    @property
    def state(self):
        """The transformers.TrainerState callbacks and reward functions read (global_step, log_history, ...)."""
        return self.control.state

    @state.setter
    def state(self, value) -> None:
        self.control.state = value
        self.rollouts.trainer_state = value  # (what reward functions get as trainer_state)

    def end(self) -> None:
        """transformers 5.18's last call of a script (TRL's scripts make it): accelerate's end of training, which
        finishes its trackers and destroys the process group. grpo's own sinks were closed when train() ended."""
        self.accelerator.end_training()

    def add_callback(self, callback) -> None:
        self.control.add(callback)

    def pop_callback(self, callback):
        return self.control.pop(callback)

    def remove_callback(self, callback) -> None:
        self.control.pop(callback)

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (it moves with use_adaptive_entropy)."""
        return self.objective.entropy_coef

    @property
    def ref_model(self):
        """The reference model: None when beta is 0 and with LoRA (the policy with its adapters off is the reference),
        as in TRL; on the CPU engine a DiskReference (its weights wait on disk between passes)."""
        return self.reference if needs_reference(self.cfg) else None

    @property
    def reward_processing_classes(self) -> list:
        """One per reward function: a reward model's tokenizer, None for a function (TRL's list)."""
        return [getattr(func, "tokenizer", None) for func in self.rewards.funcs]

    @property
    def _logs(self) -> dict[str, Any]:
        """TRL's record of the last logged rollout: prompts, completions, rewards per function, advantages, and the
        columns reward functions added with log_extra."""
        rows = self.loop.last_samples or []
        return {"prompt": [r["prompt"] for r in rows], "completion": [r["completion"] for r in rows],
                "rewards": {n: [r.get(f"reward/{n}") for r in rows] for n in self.reward_names},
                "advantages": [r["advantage"] for r in rows], "extra": dict(self.rollouts._logged_columns)}

    @property
    def hub_model_id(self) -> str | None:
        """The hub repository push_to_hub uploads to (`user/name` once the hub has answered), as TRL's."""
        return self.hub.repo_id if getattr(self, "hub", None) is not None else self.cfg.hub_model_id

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """TRL's: output_dir/README.md, a model card with the base model (a hub name; a local path is left out, as
        TRL does), the dataset, tags (grpo's and TRL's: trl, grpo), the method's paper and citation, and the metrics
        of the last logged step under TRL's names."""
        from grpo.training.run.hub import model_card
        from grpo.training.observe.metric_names import named

        if not self.accelerator.is_main_process:
            return
        base = getattr(self.policy.config, "_name_or_path", None)
        base = base if base and not Path(base).is_dir() else None
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        steps = [r for r in self.state.log_history
                 if ("reward" in r or "reward/total" in r) and "train_runtime" not in r]  # (not the summary)
        row = steps[-1] if steps else {}
        metrics = named(row, "trl", self.reward_names) if "reward/total" in row else {  # (metric_names: trl)
            k: v for k, v in row.items() if k not in ("step", "epoch")}
        card = model_card(base, model_name or Path(self.cfg.output_dir).name, self.hub_model_id or model_name or "",
                          dataset_name, list(dict.fromkeys(["trl", "grpo", *tags])), metrics)
        card.save(str(Path(self.cfg.output_dir) / "README.md"))

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, **kwargs: Any):
        """TRL's (transformers'): save_model into output_dir, write its model card (create_model_card's keywords:
        model_name, dataset_name, tags), and upload output_dir (without checkpoints and grpo's local files) to
        hub_model_id, made first if push_to_hub was not set. Collective: every process saves; the main uploads."""
        from grpo.training.run.hub import PUSH_IGNORED, start_hub

        if self.accelerator.is_main_process and getattr(self, "hub", None) is None:
            self.hub = start_hub(self.cfg, token=token)
        self.save_model()
        if not self.accelerator.is_main_process:
            return None
        model_name = kwargs.pop("model_name", None) or (self.cfg.hub_model_id or self.cfg.output_dir).rstrip("/")
        self.create_model_card(model_name=model_name.split("/")[-1], **kwargs)
        return self.hub.api.upload_folder(repo_id=self.hub.repo_id, folder_path=str(self.cfg.output_dir),
                                          commit_message=commit_message, revision=revision or self.cfg.hub_revision,
                                          ignore_patterns=PUSH_IGNORED, run_as_future=not blocking)

    def get_train_dataloader(self):
        """TRL's: a DataLoader over the training rows as TRL's yields them on this process: each prompt
        num_generations times in a row (its RepeatSampler; seeded by data_seed or seed, shuffled as
        shuffle_dataset says), one rollout's rows per batch, dataloader_num_workers workers (0 for a stream, as TRL
        forces: its repeats are in the stream). For code that inspects or iterates the data as TRL hands it out;
        train() does not read it (grpo's rollouts draw the prompts from their own sampler, in the same groups)."""
        return self._rows_loader(self.train_dataset, self.layout.rollout_completions // self.layout.processes,
                                 shuffle=self.cfg.shuffle_dataset)

    def get_eval_dataloader(self, eval_dataset=None):
        """TRL's: the eval rows (`eval_dataset`, else the trainer's; a dict's entry by name), each prompt
        num_generations times in a row, per_device_eval_batch_size rows per batch, in order; an iterable set is
        read by one worker for this loader only, as TRL scopes it. evaluate() does not read it."""
        data = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(eval_dataset, str):
            data = self.eval_dataset[eval_dataset]
        if data is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")  # (transformers' words)
        return self._rows_loader(data, self.cfg.per_device_eval_batch_size, shuffle=False)

    def _rows_loader(self, data, batch_size: int, shuffle: bool):
        from torch.utils.data import DataLoader

        from grpo.training.data.stream import is_stream

        G = self.cfg.num_generations
        cfg = self.cfg  # transformers' DataLoader settings (Trainer._get_dataloader passes the same)
        settings = {"num_workers": cfg.dataloader_num_workers,  # (pinning needs a device to copy to)
                    "pin_memory": cfg.dataloader_pin_memory and torch.cuda.is_available(),
                    "persistent_workers": cfg.dataloader_persistent_workers, "in_order": cfg.dataloader_in_order,
                    "prefetch_factor": cfg.dataloader_prefetch_factor, "collate_fn": list,
                    "multiprocessing_context": cfg.dataloader_multiprocessing_context}
        if is_stream(data):  # (its repeats are in the stream: one reader, as TRL forces; no workers to keep or feed)
            one = {"num_workers": 0, "prefetch_factor": None, "persistent_workers": False}
            return DataLoader(_Repeated(data, G), batch_size=batch_size, **{**settings, **one})
        generator = torch.Generator().manual_seed(cfg.seed if cfg.data_seed is None else cfg.data_seed)
        order = torch.randperm(len(data), generator=generator).tolist() if shuffle else range(len(data))
        indices = [i for i in order for _ in range(G)]
        return DataLoader(data, batch_size=batch_size, sampler=indices, drop_last=cfg.dataloader_drop_last,
                          **settings)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """(B, T) bool: tokens whose entropy is at least the `threshold` quantile of every process's completion-token
        entropies (TRL's method; grpo.core.masks has the math)."""
        local = entropies[mask.bool()].float()
        padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=_SENTINEL)
        gathered = self.accelerator.gather(padded)
        gathered = gathered[gathered != _SENTINEL]
        if gathered.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        return high_entropy_mask(entropies, mask, entropy_threshold(gathered, threshold))

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """(B, 1) in mask's dtype: 1 keeps a sequence, 0 drops it (negative advantage and mean KL from the sampling
        policy above the threshold; DeepSeek-V3.2). TRL's static method."""
        kept = off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask.bool(),
                               off_policy_threshold)
        return kept.to(mask.dtype)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval",
                 loss: bool = True) -> dict[str, float]:
        """Score the eval set (or `eval_dataset`: one dataset, or a dict of them, each scored and its metrics named
        with its name, as transformers does). Returns grpo's names (`eval/<metric>`, `eval/<set>/<metric>`) and TRL's
        (`eval_<metric>`, `eval_<set>_<metric>`). With `loss`, also TRL's eval loss (grpo.training.evaluation.eval_loss: it
        samples num_generations completions per prompt once more); the training loop's evaluations leave it out."""
        from grpo.training.data.prompts import build_prompt_set
        from grpo.training.evaluation.eval_loss import eval_loss

        if eval_dataset is not None:
            sets = eval_sets(eval_dataset, lambda data: build_prompt_set(
                data, self.tokenizer, self.cfg, self.prefill, "eval_dataset", agents=self.agents,
                images=self.images))
        else:
            sets = self.eval_set
        if sets is None:
            raise ValueError("evaluate: no eval_dataset was given to GRPOTrainer or to evaluate(eval_dataset=...).")
        named = sets.items() if isinstance(sets, dict) else [(None, sets)]
        out = {}
        for name, prompt_set in named:
            started = time.perf_counter()
            result = self._score_eval_set(prompt_set)
            if loss:
                result["loss"] = eval_loss(self.rollouts, self.objective, self.reference, self.accel, prompt_set)
            ours = "eval/" if name is None else f"eval/{name}/"
            theirs = f"{metric_key_prefix}_" if name is None else f"{metric_key_prefix}_{name}_"
            out.update({ours + k: v for k, v in result.items()})
            out.update({theirs + k: v for k, v in result.items() if k not in (ignore_keys or ())})
            out[theirs + "runtime"] = round(time.perf_counter() - started, 4)
        return out


def as_map_style(dataset):
    """A streamed eval set read whole (eval sets are small, and every eval reads every prompt)."""
    from grpo.training.data.stream import is_stream

    if is_stream(dataset):
        import datasets

        return datasets.Dataset.from_list(list(dataset))
    return dataset


def eval_sets(eval_dataset, build) -> Any:
    """The prompt set(s) of the eval data given at init: `build(dataset)` for one dataset, a dict of them for a dict
    (or DatasetDict) of datasets, as TRL takes `eval_dataset`."""
    if eval_dataset is None:
        return None
    if isinstance(eval_dataset, dict):
        return {name: build(as_map_style(one)) for name, one in eval_dataset.items()}
    return build(as_map_style(eval_dataset))


class TrainingSummary:
    """The end-of-training entry transformers' Trainer appends to log_history (and returns in TrainOutput.metrics):
    train_runtime, train_samples_per_second, train_steps_per_second, total_flos, train_loss, with epoch and step. As
    TRL's `log` does, the entry also carries the TRL-named means of the steps since the last logged one."""

    def __init__(self):
        self.started = time.perf_counter()
        self.loss_sum, self.steps, self.first_step = 0.0, 0, 0
        self.unlogged: list[dict[str, float]] = []  # the steps after the last logged step
        self.last: list[dict[str, float]] = []  # the last step

    def start(self, step: int) -> None:
        self.started, self.loss_sum, self.steps, self.first_step = time.perf_counter(), 0.0, 0, step
        self.unlogged = []

    def add(self, metrics: dict[str, float]) -> None:
        """One optimizer step's metrics (before it is logged or not)."""
        loss = metrics.get("train/loss")
        if loss is not None:
            self.loss_sum += float(loss)
            self.steps += 1
        self.unlogged.append(dict(metrics))
        self.last = [self.unlogged[-1]]

    def logged(self) -> None:
        self.unlogged = []

    def metrics(self, step: int, step_completions: int, reward_names: list[str],
                total_flos: float) -> dict[str, float]:
        from grpo.training.observe.metric_names import named

        runtime = time.perf_counter() - self.started
        steps = step - self.first_step
        samples = steps * step_completions
        # (when every step was logged, the last step's: TRL's entry would have none, but code reads log_history[-1])
        pending = [named(m, "trl", reward_names) for m in self.unlogged or self.last]
        means = {k: sum(p[k] for p in pending if k in p) / sum(k in p for p in pending)
                 for k in {k for p in pending for k in p}}
        return {**means,
                "train_runtime": round(runtime, 4),
                "train_samples_per_second": round(samples / runtime, 3) if runtime > 0 else 0.0,
                "train_steps_per_second": round(steps / runtime, 3) if runtime > 0 else 0.0,
                "total_flos": float(total_flos or 0.0),
                "train_loss": self.loss_sum / self.steps if self.steps else 0.0}


class _Repeated(torch.utils.data.IterableDataset):
    """A stream's rows, each `times` times in a row (TRL's repeat_iterable_dataset)."""

    def __init__(self, data, times: int):
        self.data, self.times = data, times

    def __iter__(self):
        for row in self.data:
            for _ in range(self.times):
                yield row


def data_without_dataset(cfg, train_dataset, world: int, reward_funcs, tools, environment_factory, rollout_func):
    """(train_dataset, whether the config's task may supply the data) when GRPOTrainer got no train_dataset.

    A config (`grpo train`, GRPOTrainer(args=...)) with no dataset trains on its task, as before. A caller who passed
    rewards, tools, environments or a rollout_func to GRPOTrainer and no dataset gets TRL's error, not the built-in
    task's data, unless an environment_factory owns the data: then, as TRL does, each prompt is an empty user message
    that the environment's reset() fills in, and max_steps sets the length."""
    from grpo.training.data.stream import is_stream

    extras = cfg.__dict__.setdefault("_trl_extras", {})
    if is_stream(train_dataset):  # TRL's settings for a stream (moot here: there is no DataLoader), as args reads them
        from transformers.trainer_pt_utils import AcceleratorConfig

        given = extras.get("accelerator_config") or {}
        given = dict(given) if isinstance(given, dict) else dataclasses.asdict(given)
        if given.get("dispatch_batches"):  # (TRL's error, word for word)
            raise ValueError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                             "`accelerator_config`. Please set it to `False`.")
        extras["accelerator_config"] = AcceleratorConfig(**{**given, "dispatch_batches": False})
        if extras.get("dataloader_num_workers"):
            extras["dataloader_num_workers"] = 0
    explicit = "task" in cfg.__dict__.get("_explicit", ())
    if train_dataset is not None or cfg.dataset_name is not None or explicit:
        return train_dataset, train_dataset is None or explicit
    if all(x is None for x in (reward_funcs, tools, environment_factory, rollout_func)):
        return None, True
    if environment_factory is None:
        raise ValueError("`train_dataset` is required unless an `environment_factory` is provided (or set "
                         "dataset_name, or task=... to train on a built-in task).")
    if isinstance(environment_factory, dict):
        raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                         "`environment` column to route each example to its environment.")
    if cfg.max_steps <= 0:
        raise ValueError("max_steps: when training without a `train_dataset` (the environment owns the data and "
                         "returns the prompt from reset()), set max_steps to a positive number of steps.")
    from grpo.training.update.steps import resolve_layout

    rows = resolve_layout(cfg, world).prompts_per_rollout
    return placeholder_prompts(rows), False


def placeholder_prompts(rows: int):
    import datasets

    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})


def with_prompt_column(dataset, agents):
    """A dataset of environments only (TRL's multiple-environments example: an `environment` column, no prompt):
    each row's prompt is an empty user message that its environment's reset() fills in."""
    from grpo.training.data.prompts import PROMPT_COLUMN_CANDIDATES

    if dataset is None or agents is None or getattr(agents, "environments", None) is None:
        return dataset
    columns = getattr(dataset, "column_names", None) or []
    if not columns or any(c in columns for c in PROMPT_COLUMN_CANDIDATES):
        return dataset
    return dataset.add_column("prompt", [[{"role": "user", "content": ""}]] * len(dataset))


_TOKEN_SUMMED = ("micro_batch_token_mean", "constant", "rollout_token_mean")  # TRL's bnpo, dr_grpo, dapo / cispo


def warn_as_trl(cfg) -> None:
    """TRL's warnings about a config that runs but is likely not what was meant (its wording, so code and people
    that look for it find it), and one line for each open-r1 key that drives only open-r1's infrastructure."""
    import logging

    if (cfg.importance_sampling_level == "sequence" and cfg.loss_aggregation in _TOKEN_SUMMED
            and cfg.surrogate != "vespo"):
        logging.getLogger("grpo").warning(
            "importance_sampling_level='sequence' with loss_aggregation=%r: the loss sums per-token contributions, "
            "which effectively weights each sequence by its completion length instead of following the GSPO "
            "objective (one weight per sequence); use loss_type='grpo' (sequence_mean) for GSPO.",
            cfg.loss_aggregation)
    from grpo.config.trl_keys import accepted_default

    benchmarks, callbacks = accepted_default(cfg, "benchmarks"), accepted_default(cfg, "callbacks")
    if benchmarks:
        logging.getLogger("grpo").warning("open-r1: benchmarks %s are skipped (open-r1 runs them as Slurm jobs after "
                                          "training); run lighteval on %s/final.", ", ".join(benchmarks),
                                          cfg.output_dir)
    if callbacks:
        logging.getLogger("grpo").warning("open-r1: callback push_to_hub_revision is skipped (a hub branch per "
                                          "checkpoint is not built); push_to_hub uploads to hub_revision.")
