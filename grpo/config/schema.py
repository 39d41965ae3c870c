"""`GRPOConfig`: every setting of a run, its default and its one-line meaning.

Key names follow TRL's `GRPOConfig` (and `TrainingArguments`, `ModelConfig`, open-r1's recipes) where those exist,
with TRL's meaning; TRL's keys that grpo does not implement are accepted at TRL's default and refused otherwise
(grpo.config.trl_keys, docs/from_trl.md). Construction (`GRPOConfig(...)`, `from_dict`, `load`) applies aliases,
checks TRL's keys, fills a `preset`'s values into every key not given, coerces types and validates once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grpo.config.base import DEFAULT_MODEL, SCRIPT_KEYS, Kwargs, Names, Paths, Specs, _f
from grpo.config.trl_fields import TrlKeys
from grpo.tasks import TASKS


@dataclass(init=False)
class GRPOConfig(TrlKeys):  # (TrlKeys: TRL's keys that are not settings of ours, for argument parsers; to_dict)
    # ---- model -------------------------------------------------------------------------------------------------
    model_name_or_path: str = _f(DEFAULT_MODEL, "Model to train: a local Hugging Face directory, a hub name, or a "
                                 "model shipped in the package by name (tiny-arith, tiny-tools, tiny-vision, "
                                 "tiny-moe). Default: tiny-arith.")
    model_revision: str = _f("main", "Revision (branch, tag or commit) of a hub model (TRL ModelConfig).")
    model_init_kwargs: Kwargs = _f(None, "Further keyword arguments for from_pretrained (TRL's), e.g. "
                                        "{device_map: auto}; dtype, revision and attn_implementation here win.")
    trust_remote_code: bool = _f(False, "Allow models and tokenizers that ship their own Python code.")
    torch_dtype: str = _f("float32", "Weights dtype.", ("float32", "bfloat16", "float16", "auto"))
    bf16: bool | None = _f(False, "bfloat16 mixed precision (TRL's meaning: autocast over float32 weights unless "
                    "torch_dtype says otherwise; null: true unless fp16).")
    fp16: bool = _f(False, "float16 mixed precision with a loss scaler (a CUDA GPU).")
    tf32: bool | None = _f(None, "Allow TF32 matmuls on Ampere or newer GPUs (null: torch's default).")
    use_cpu: bool = _f(False, "Train on the CPU even when a GPU is present.")
    attn_implementation: str | None = _f(None, "Attention kernel passed to from_pretrained (eager, sdpa, "
                                         "flash_attention_2). Default: transformers' choice.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory (slower).")
    gradient_checkpointing_kwargs: Kwargs = _f(None, "Passed to gradient_checkpointing_enable().")
    activation_offloading: bool = _f(False, "Keep what the update's forward saves for backward in pinned host "
                                     "memory until backward (TRL's key for SFT/DPO; verl's enable_activation_offload):"
                                     " device memory for long completions; with gradient_checkpointing, the layers' "
                                     "inputs move. Moves nothing on a CPU-only run (docs/long.md).")
    disable_dropout: bool = _f(False, "Turn every dropout off, so the update's log-probs match sampling's.")
    cast_lm_head_to_fp32: bool = _f(False, "The LM head in float32 (TRL's key, the ScaleRL recipe): its weight cast "
                                    "to float32 and its product taken in float32 with autocast off, for the policy "
                                    "and the reference, so bf16 logits are not rounded before the softmax.")
    use_liger_kernel: bool = _f(False, "Patch the model's layers with Liger's Triton kernels (pip install "
                                "liger-kernel; CUDA), as TRL does: the log-probs still come from grpo's own head.")
    load_in_4bit: bool = _f(False, "QLoRA: load the base model in 4 bits through bitsandbytes (needs a CUDA GPU).")
    bnb_4bit_quant_type: str = _f("nf4", "4-bit quantization type.", ("nf4", "fp4"))
    use_bnb_nested_quant: bool = _f(False, "Quantize the 4-bit quantization constants too.")
    use_peft: bool = _f(False, "Train LoRA adapters (peft) instead of all weights.")
    lora_r: int = _f(16, "LoRA rank.")
    lora_alpha: int = _f(32, "LoRA alpha (scaling = alpha / r).")
    lora_dropout: float = _f(0.05, "LoRA dropout.")
    lora_target_modules: Names = _f("all-linear", "Modules that get adapters: a list of names or 'all-linear'.")
    lora_target_parameters: list[str] | None = _f(None, "Parameters that get adapters (peft's target_parameters): "
                                                  "an MoE's stacked experts, e.g. [mlp.experts.gate_up_proj].")
    lora_modules_to_save: list[str] | None = _f(None, "Modules trained in full beside the adapters (e.g. [lm_head]).")
    freeze_vision_tower: bool = _f(False, "A vision-language model's vision side (its tower and the projector into "
                                   "the language model) is not trained (verl's key): its weights get no gradient, "
                                   "and with LoRA no adapters. False: trained as the rest (full fine-tuning), or "
                                   "through adapters where lora_target_modules reach it ('all-linear' does).")
    use_rslora: bool = _f(False, "Rank-stabilized LoRA scaling (alpha / sqrt(r)).")
    use_dora: bool = _f(False, "Weight-decomposed LoRA (DoRA).")
    merge_lora_on_save: bool = _f(True, "Merge adapters into the base weights in final/ (adapters are also "
                                  "saved separately in final/adapter/).")

    # ---- data --------------------------------------------------------------------------------------------------
    task: str | None = _f("arithmetic", f"Built-in task ({', '.join(TASKS)}) used when dataset_name is "
                          "not set; it also supplies default rewards and prefill.")
    task_difficulty: int | None = _f(None, "Difficulty level of the built-in task (default: the task's own).")
    task_train_size: int = _f(20000, "Number of generated training problems of the built-in task.")
    task_eval_size: int = _f(200, "Number of held-out problems of the built-in task used for eval during training.")
    dataset_name: str | None = _f(None, "Training data: a jsonl/json/csv/parquet file, a save_to_disk "
                                  "directory, or a hub dataset name.")
    dataset_config: str | None = _f(None, "Hub dataset configuration name.")
    dataset_streaming: bool = _f(False, "Read dataset_name as a stream (datasets' streaming=True): rows are read as "
                                 "the run needs them, never all in memory; needs max_steps. Resume is exact.")
    dataset_split: str = _f("train", "Split of dataset_name to train on.")
    eval_dataset_name: str | None = _f(None, "Eval data (same forms as dataset_name).")
    eval_split: str = _f("test", "Split of eval_dataset_name.")
    prompt_column: str | None = _f(None, "Column holding the prompt text or chat messages. Default: the first "
                                   "of prompt, problem, question present.")
    remove_unused_columns: bool = _f(False, "Pass reward functions only the prompt, not the dataset's other "
                                     "columns (TRL's meaning; its default keeps them too).")
    shuffle_dataset: bool = _f(True, "Shuffle the prompts each epoch (false: dataset order).")
    data_seed: int | None = _f(None, "Seed of the prompt order (null: seed).")
    shuffle_buffer_size: int = _f(1000, "With dataset_streaming and shuffle_dataset: rows in the shuffle buffer "
                                  "(IterableDataset.shuffle's buffer_size; data_seed seeds it, reshuffled per epoch).")
    dataset_on_bad_row: str = _f("raise", "A row with a missing or non-text prompt, or a missing/NaN value in a "
                                 "column the rewards read: stop with an error naming the row, or skip it and count "
                                 "it (metric data/skipped_rows).", ("raise", "skip"))
    system_prompt: str | None = _f(None, "System prompt. With a chat template a text prompt becomes [system, "
                                   "user] messages, as open-r1 builds it (rewards then get messages); without one "
                                   "it is a prefix.")
    chat_template: str | None = _f(None, "A Jinja chat template that replaces the tokenizer's (open-r1's key).")
    chat_template_kwargs: Kwargs = _f(None, "Further keyword arguments for apply_chat_template.")
    prefill: str | None = _f(None, "Text the completion is forced to start with, e.g. '<think>'. Default: the "
                             "task's prefill (a built-in task's data file included), else none.")
    use_chat_template: bool | None = _f(None, "Render text prompts with the tokenizer's chat template: true, false, "
                                        "or null (also spelled auto): when the tokenizer has one. Message prompts "
                                        "always use it.")
    max_prompt_length: int | None = _f(512, "Longest prompt in tokens (null: no limit).")
    prompt_truncation: str = _f("error", "What to do with a longer prompt.", ("error", "left"))

    # ---- rewards -----------------------------------------------------------------------------------------------
    reward_funcs: Specs = _f([], "Reward functions: built-in names, 'module:function' paths, reward-model dirs, "
                            "reward-server URLs, or {name: ..., <factory args>} maps. Default: the task's.")
    reward_weights: list[float] | None = _f(None, "One weight per reward function. Default: the task's, else all 1.")
    multi_objective_aggregation: str = _f("sum_then_normalize", "Combine several rewards: weighted sum, then "
                                          "group advantages; or each reward normalized in its group, summed, then "
                                          "normalized over the batch (GDPO, TRL's).",
                                          ("sum_then_normalize", "normalize_then_sum"))
    reward_on_error: str = _f("raise", "A reward function that raises: stop with an error naming it, or count "
                              "it and score 0.", ("raise", "zero"))
    reward_on_nonfinite: str = _f("raise", "A NaN/inf reward: stop with an error, or treat it as 'does not "
                                  "apply' (None) and count it.", ("raise", "none"))
    reward_on_all_none: str = _f("warn", "A completion every reward function returned None for: warn and give it "
                                 "advantage 0 (TRL's), or stop with an error naming the row.", ("warn", "raise"))
    reward_timeout: float | None = _f(60.0, "Seconds one reward-function call may take before it counts as failed "
                                      "(reward_on_error decides: stop, or score the batch 0). null: no limit.")
    open_r1_rewards: Kwargs = _f({}, "Settings of open-r1's reward functions by open-r1's key names (cosine_max_len, "
                               "repetition_n_grams, code_language, ...); set them as top-level keys.")
    step_reward_funcs: list[str] = _f([], "Step-reward functions for process supervision (e.g. arithmetic_steps).")
    process_weight: float = _f(1.0, "Weight of the process (step) advantages when step_reward_funcs is set.")
    outcome_weight: float = _f(1.0, "Weight of the outcome advantages when step_reward_funcs is set "
                               "(0 = process supervision alone).")

    # ---- generation and batch layout ---------------------------------------------------------------------------
    num_generations: int = _f(8, "Completions per prompt: the group size G.")
    prompts_per_step: int | None = _f(None, "Prompts per optimizer step, all processes together (sets the "
                                      "completions per optimizer step; per_device_train_batch_size then caps the "
                                      "micro-batch). Default: from per_device_train_batch_size x "
                                      "gradient_accumulation_steps x processes, as TRL.")
    per_device_train_batch_size: int = _f(8, "Completions per forward/backward pass on one process.")
    max_tokens_per_micro_batch: int | None = _f(None, "Token-budget micro-batches (verl's use_dynamic_bsz with "
                                                "ppo_max_token_len_per_gpu, an alias): fill each micro-batch of the "
                                                "update and the reference pass with completions up to this many "
                                                "tokens on one process, instead of per_device_train_batch_size "
                                                "completions (null), so long and short completions cost what they "
                                                "are. A completion longer than the budget goes alone. With "
                                                "sequence_parallel_size N the budget is still per process: a "
                                                "micro-batch's tokens are split over N, so it takes up to N times "
                                                "this and a row fits when its length / N does.")
    use_remove_padding: bool = _f(True, "Padding-free passes (verl's key): the update's and the reference pass's "
                                  "sequences packed end to end, a group's prompt once where the attention takes a "
                                  "custom mask (sdpa, eager), so the model computes real tokens only (docs/engines.md). "
                                  "false: rows padded to the longest. The run prints which it took.")
    sequence_parallel_size: int = _f(1, "Processes that share one packed micro-batch, each holding a 1/N slice of its "
                                     "tokens, attention head-parallel (Ulysses; verl's "
                                     "ulysses_sequence_parallel_size, accelerate's parallelism_config.sp_size): "
                                     "launch a multiple of it; each group of that many processes is one "
                                     "data-parallel rank (docs/long.md).")
    router_replay: str = _f("off", "MoE routing replay (docs/moe.md): R3 forces, in every training pass, the experts "
                            "each token was routed to in the rollout, weights from the live router (verl's R3, "
                            "NeMo-RL's router_replay.enabled; disabled and r3 are aliases). off: moe/routing_mismatch "
                            "logs the share of tokens routed otherwise.", ("off", "R3", "disabled", "r3"))
    router_aux_loss_coef: float | None = _f(None, "Weight of an MoE's load-balancing loss in the loss, as TRL adds it "
                                            "(moe/aux_loss); null: the model config's router_aux_loss_coef; 0: none.")
    expert_parallel_size: int = _f(1, "Processes that split each MoE layer's experts, each holding 1/N (docs/moe.md; "
                                   "Megatron's expert_model_parallel_size, transformers' ep_size): groups of "
                                   "consecutive ranks, data-parallel otherwise; launch a multiple of it.")
    gradient_accumulation_steps: int | None = _f(None, "Micro-batches per optimizer step on each process. Default: "
                                                 "what prompts_per_step needs, else 1.")
    steps_per_generation: int | None = _f(None, "Micro-batch passes one rollout feeds (TRL's): a multiple of "
                                          "gradient_accumulation_steps; default equal to it (one optimizer step).")
    generation_batch_size: int | None = _f(None, "Completions per rollout, all processes (TRL's); sets "
                                           "steps_per_generation.")
    max_completion_length: int = _f(256, "Most tokens generated per completion.")
    temperature: float = _f(1.0, "Sampling temperature (log-probs are computed at the same temperature).")
    top_p: float = _f(1.0, "Nucleus sampling threshold.")
    top_k: int = _f(0, "Top-k sampling (0: off).")
    min_p: float | None = _f(0.0, "Min-p sampling (0 or null: off).")
    repetition_penalty: float = _f(1.0, "Repetition penalty in sampling (1: off).")
    generation_kwargs: Kwargs = _f(None, "Sampling settings by transformers' names (max_new_tokens, "
                                        "temperature, top_p, top_k, min_p, repetition_penalty); they win.")
    engine: str = _f("auto", "Rollout and update engine: cpu (compiled paths for a float32 model in one process on "
                     "the CPU), transformers (any model and device), or auto: cpu where it applies, transformers "
                     "otherwise. The run prints which it took and why.", ("auto", "transformers", "cpu"))
    ds3_gather_for_generation: bool = _f(True, "With sharded weights (FSDP2, DeepSpeed ZeRO-3): sample from the "
                                         "whole weights, gathered for each rollout and released after (TRL's key; "
                                         "TRL applies it to ZeRO-3 only). false: sample through the sharded model, "
                                         "slower but within memory.")
    use_vllm: bool = _f(False, "Generate with vLLM (TRL's key): pip install 'grpo[vllm]' on a GPU machine, or the "
                        "CPU build in an environment of its own (bash scripts/vllm_env.sh).")
    vllm_mode: str = _f("colocate", "colocate: a vLLM engine in the trainer's process, on its device; server: a "
                        "`grpo vllm-serve` process that every trainer process sends prompts to. Either is given the "
                        "policy's weights after every optimizer step.", ("colocate", "server"))
    vllm_server_base_url: None | str | list[str] = _f(None, "Server mode: the server's URL (http://10.0.0.2:8000), "
                                                      "or several (a list or comma-separated); wins over host/port.")
    vllm_server_host: str = _f("0.0.0.0", "Server mode: the server's host, or several (host or host:port, separated "
                                "by commas); on several machines the server's address, not 0.0.0.0.")
    vllm_server_port: int = _f(8000, "Server mode: the server's port.")
    vllm_server_timeout: float = _f(240.0, "Server mode: seconds to wait for the server to answer at start.")
    vllm_weight_transfer: str = _f("collective", "Server mode: how the weights reach the server after each step: "
                                   "collective (a process group with the server, NCCL between GPUs, gloo "
                                   "otherwise, as TRL's vllm-serve) or http (a streamed POST).",
                                   ("collective", "http"))
    vllm_group_port: int = _f(51216, "Server mode, collective transfer: the port the server opens for it (TRL's).")
    vllm_gpu_memory_utilization: float = _f(0.3, "Fraction of the device's memory vLLM may take (its weights and KV "
                                            "cache; on vLLM's CPU build, of the machine's RAM).")
    vllm_tensor_parallel_size: int = _f(1, "Devices one vLLM engine shards the model over.")
    vllm_enable_sleep_mode: bool = _f(False, "Free vLLM's device memory during the update (vLLM's sleep mode; "
                                      "GPU only) and take it back for the next rollout.")
    vllm_max_model_length: int | None = _f(None, "Context length of the vLLM engine (null: the model's).")
    vllm_model_impl: str = _f("vllm", "Model implementation vLLM runs: its own or transformers'.",
                              ("vllm", "transformers"))
    vllm_engine_kwargs: Kwargs = _f({}, "Further keyword arguments for vllm.LLM (e.g. enforce_eager: true).")
    vllm_per_row_seeds: bool | None = _f(None, "Seed every row of a vLLM request (completions independent of how "
                                         "rows are split across processes, as grpo's samplers; vLLM then samples "
                                         "row by row) or seed the engine once (vLLM's batched sampler). null: "
                                         "true on the CPU, false on GPUs.")
    max_staleness: int = _f(0, "Asynchronous rollouts (TRL 1.18 AsyncGRPOTrainer's key): rollout t is generated "
                            "with exactly the weights of k = max_staleness rollouts before (optimizer step "
                            "t - k), in a worker process (with vllm_mode: server, by the server), while the update "
                            "runs; 0: synchronous. Stale rows are "
                            "weighted by pi_old / pi_sampling as vllm_importance_sampling_* say (docs/async.md).")
    vllm_importance_sampling_correction: bool = _f(True, "Weight each token's surrogate by pi_old / pi_vllm, "
                                                   "bounded as vllm_importance_sampling_mode says (TRL 1.16's); "
                                                   "with max_staleness > 0, pi_old / pi_sampling (decoupled PPO).")
    vllm_importance_sampling_mode: str = _f("sequence_mask", "token_truncate, token_mask, sequence_truncate or "
                                            "sequence_mask (grpo.core.engine_importance_weights).",
                                            ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"))
    vllm_importance_sampling_clip_max: float | None = _f(3.0, "Upper bound of the importance ratio (null: none).")
    vllm_importance_sampling_clip_min: float | None = _f(None, "Lower bound of the importance ratio (null: none).")

    # ---- tools and environments (multi-turn rollouts; docs/agents.md) -------------------------------------------
    tools: list[str] = _f([], "Tools the model may call: built-in names (calculator, python) or 'module:function' "
                          "paths (functions with type hints and an Args: docstring; the Python API takes the "
                          "functions too). Default: the task's. Needs a chat template that renders tool calls; tool "
                          "answers are left out of the loss.")
    environment_factory: Paths = _f(None, "TRL's environment_factory: a 'module:Class' path whose instances' "
                                  "public methods are the tools, or a map of such paths by the environment column.")
    rollout_func: str | None = _f(None, "TRL's rollout_func: a 'module:function' path of a rollout of your own "
                                  "(called with this process's prompts and the trainer).")
    agent: str | None = _f(None, "'module:function' of an agent's episode(client, row), trained via the endpoint.")
    agent_kwargs: Kwargs = _f(None, "Settings of agent's Episodes: processes (worker processes for the episodes; "
                              "0: the trainer's), timeout_s, window_s, host, port, token, client_kwargs.")
    max_tool_calling_iterations: int | None = _f(None, "Most rounds of tool calls per completion (TRL's key); null: "
                                                 "until max_completion_length, which counts tool answers too.")
    tool_timeout: float = _f(10.0, "Seconds one tool call may take; past it the model is answered with an error "
                             "and the call counts in tools/errors/timeout.")
    max_tool_output_chars: int = _f(2000, "Longest tool answer the model is shown, in characters; a longer one is "
                                    "cut, with a note of how much was left out.")

    # ---- optimization ------------------------------------------------------------------------------------------
    learning_rate: float = _f(1e-6, "Peak AdamW learning rate.")
    lr_scheduler_type: str = _f("constant", "Learning-rate schedule after warmup.",
                                ("constant", "linear", "cosine", "constant_with_warmup", "cosine_with_min_lr"))
    lr_scheduler_kwargs: Kwargs = _f(None, "Schedule settings: num_cycles (cosine), min_lr or min_lr_rate "
                                          "(cosine_with_min_lr).")
    warmup_ratio: float = _f(0.0, "Fraction of steps spent warming up linearly (used when warmup_steps is 0).")
    warmup_steps: float = _f(0, "Warmup optimizer steps; below 1, a fraction of them (transformers 5).")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Clip the gradient norm to this (0: no clipping).")
    max_nonfinite_steps: int = _f(3, "Stop after this many optimizer steps in a row with a non-finite gradient "
                                  "(each one is skipped and its inputs saved under output_dir/nonfinite/).")
    max_steps: int = _f(-1, "Optimizer steps to train (TRL's count). -1: use num_train_epochs.")
    num_train_epochs: float = _f(1.0, "Passes over the training prompts (when max_steps is -1).")
    num_iterations: int = _f(1, "Passes over each rollout (mu in the paper), each of its optimizer steps.")
    num_threads: int | None = _f(None, "CPU threads for torch. null: OMP_NUM_THREADS if set, else 1 for a model "
                                 "of decoder layers up to 32 MiB, else the usable CPUs over this run's processes "
                                 "on the machine (grpo/training/setup/threads.py).")
    seed: int = _f(42, "Seed of data order, sampling and initialization: a CPU run repeats exactly.")
    full_determinism: bool = _f(False, "Deterministic algorithms only (torch.use_deterministic_algorithms).")

    # ---- loss --------------------------------------------------------------------------------------------------
    beta: float = _f(0.04, "KL penalty coefficient (DeepSeekMath: 0.04). 0 skips the reference model.")
    reference_weights: str = _f("auto", "Where the reference model's weights stay between reference passes (beta > 0, "
                                "full fine-tuning): memory, or disk (a file in output_dir that each pass maps back "
                                "in, so the process holds them only during that pass; ~10 ms per step for a 170 MB "
                                "reference). auto: disk with the cpu engine, memory otherwise.",
                                ("auto", "memory", "disk"))
    kl_estimator: str = _f("k3", "KL estimator (Schulman): k1, k2 or k3 (the paper's).", ("k1", "k2", "k3"))
    use_bias_correction_kl: bool = _f(False, "Multiply the KL term by the importance ratio (DeepSeek-V3.2; TRL's "
                                      "default), which changes its gradient even on-policy.")
    sync_ref_model: bool = _f(False, "Every ref_model_sync_steps optimizer steps, move the reference towards the "
                              "policy: ref = alpha * policy + (1 - alpha) * ref (TR-DPO).")
    ref_model_mixup_alpha: float = _f(0.6, "alpha of sync_ref_model.")
    ref_model_sync_steps: int = _f(512, "Optimizer steps between reference syncs.")
    surrogate: str = _f("clip", "Per-token objective: PPO's clipped ratio (clip), CISPO's clipped weight on the "
                        "log-prob (cispo), SAPO's soft gate (sapo), VESPO's gamma-weighted log-prob (vespo).",
                        ("clip", "cispo", "sapo", "vespo"))
    epsilon: float = _f(0.2, "Clip range: ratio clipped to [1-epsilon, 1+epsilon_high].")
    epsilon_high: float | None = _f(None, "Upper clip range (DAPO clip-higher uses 0.28; cispo's cap on the "
                                    "ratio itself). Default: epsilon.")
    delta: float | None = _f(None, "Two-sided clip (INTELLECT-2): the ratio is also capped at delta.")
    sapo_temperature_pos: float = _f(1.0, "SAPO gate temperature for positive advantages.")
    sapo_temperature_neg: float = _f(1.05, "SAPO gate temperature for other advantages.")
    vespo_k_pos: float = _f(2.0, "VESPO power k for advantages >= 0.")
    vespo_lambda_pos: float = _f(3.0, "VESPO decay lambda for advantages >= 0.")
    vespo_k_neg: float = _f(3.0, "VESPO power k for negative advantages.")
    vespo_lambda_neg: float = _f(2.0, "VESPO decay lambda for negative advantages.")
    importance_sampling_level: str = _f("token", "Ratio per token (GRPO) or per sequence (GSPO).",
                                        ("token", "sequence"))
    loss_aggregation: str = _f("sequence_mean", "How token losses are averaged: per sequence then over sequences "
                               "(paper), over the optimizer step's tokens, by a constant (Dr. GRPO), summed per "
                               "sequence (LUSPO), or TRL's per-micro-batch (bnpo) and per-rollout (dapo) token "
                               "means.", ("sequence_mean", "token_mean", "constant", "sequence_sum",
                                          "micro_batch_token_mean", "rollout_token_mean"))
    loss_type: str | None = _f(None, "TRL's name for a loss_aggregation and surrogate pair: grpo, bnpo, dr_grpo, "
                               "dapo, cispo, sapo, luspo, vespo (docs/from_trl.md).")
    off_policy_mask_threshold: float | None = _f(None, "Leave out of the surrogate the sequences with a negative "
                                                 "advantage whose mean KL from the sampling policy exceeds this "
                                                 "(DeepSeek-V3.2).")
    top_entropy_quantile: float = _f(1.0, "Keep only the top quantile of tokens by entropy in the surrogate "
                                     "(Beyond the 80/20 rule: 0.2); 1 keeps all.")
    entropy_coef: float = _f(0.0, "Entropy bonus: minus this times the mean token entropy is added to the loss.")
    use_adaptive_entropy: bool = _f(False, "Skywork-OR1 adaptive entropy: the coefficient rises by "
                                    "entropy_coef_delta while entropy is at or below entropy_target, falls otherwise, "
                                    "and applies only at or below the target.")
    entropy_coef_min: float = _f(0.0, "Lowest adaptive entropy coefficient.")
    entropy_coef_max: float = _f(1.0, "Highest adaptive entropy coefficient.")
    entropy_coef_delta: float = _f(0.005, "Step of the adaptive entropy coefficient per optimizer step.")
    entropy_target: float = _f(0.2, "Target mean token entropy (nats) of adaptive entropy.")
    scale_rewards: str = _f("group", "Std used to scale advantages (TRL's true = group, false = none).",
                            ("group", "batch", "none"))
    advantage_eps: float = _f(1e-4, "Added to the std before dividing.")
    unbiased_std: bool = _f(True, "Bessel-corrected (n-1) std, as the seeds compute it.")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose rewards are all equal and sample "
                                "more prompts until the step has prompts_per_step groups (one process only).")
    max_generation_rounds: int = _f(3, "Most generation rounds per step with dynamic_sampling; after that the step "
                                    "trains on the groups it has.")
    overlong_buffer_ratio: float = _f(0.0, "DAPO soft overlong punishment: completions longer than (1 - ratio) x "
                                      "max_completion_length lose up to 1 reward, linearly (0: off).")
    mask_truncated_completions: bool = _f(False, "Leave completions cut at max_completion_length out of the loss.")

    # ---- logging, eval, checkpoints ----------------------------------------------------------------------------
    output_dir: str = _f("runs/default", "Run directory: metrics, samples, checkpoints, final model.")
    run_name: str | None = _f(None, "Name of the run in W&B / Trackio.")
    project: str = _f("huggingface", "Trackio project (TRL's).")
    wandb_project: str | None = _f(None, "W&B project (null: WANDB_PROJECT, else grpo).")
    wandb_entity: str | None = _f(None, "W&B entity (team) of the run.")
    wandb_run_group: str | None = _f(None, "W&B group of the run.")
    logging_dir: str | None = _f(None, "TensorBoard directory (null: TENSORBOARD_LOGGING_DIR, else "
                                 "output_dir/runs/<date>_<host>/ as transformers).")
    log_level: str = _f("passive", "Log level of grpo's and transformers' loggers (passive: leave them).",
                        ("passive", "debug", "info", "warning", "error", "critical"))
    logging_strategy: str = _f("steps", "When metrics are logged: every logging_steps, each epoch's end, or "
                               "never (metrics.jsonl then holds evals only).", ("steps", "epoch", "no"))
    logging_steps: float = _f(1, "Print and log metrics every N optimizer steps (below 1: a fraction of them).")
    logging_first_step: bool = _f(False, "Also log the first optimizer step.")
    metric_names: str = _f("both", "Metric names in metrics.jsonl and callbacks: grpo's (policy/kl_divergence), "
                           "TRL's (kl), or both; dashboards get TRL's as train/kl (docs/from_trl.md).",
                           ("both", "grpo", "trl"))
    log_completions: bool | None = _f(None, "TRL's: true logs samples every logging_steps, false never "
                                      "(null: log_completions_steps decides).")
    log_completions_steps: int = _f(10, "Write sample completions with their rewards every N steps (0: never).")
    num_completions_to_print: int | None = _f(None, "Also print this many sample completions each time samples are "
                                              "logged (null: none).")
    log_unique_prompts: bool = _f(False, "Samples: one completion per distinct prompt.")
    report_to: Names = _f(["tensorboard"], "Metric sinks besides metrics.jsonl: tensorboard, wandb, trackio, all "
                         "(every installed one), none.")
    disable_tqdm: bool | None = _f(None, "Turn the live progress display off.")
    eval_strategy: str = _f("steps", "When to score the eval set: every eval_steps, each epoch's end, or never.",
                            ("steps", "epoch", "no"))
    eval_steps: float | None = _f(0, "Score the eval set every N steps (0: only at the end when an eval set "
                                        "exists; null: logging_steps; below 1: a fraction of the steps).")
    eval_on_start: bool = _f(True, "Score the eval set before the first step when evaluating every N steps.")
    per_device_eval_batch_size: int = _f(256, "Eval completions generated at once.")
    eval_num_samples: int = _f(1, "Completions per eval prompt (k of pass@k).")
    eval_temperature: float = _f(1.0, "Sampling temperature for eval.")
    save_strategy: str = _f("steps", "When to write a checkpoint: every save_steps, each epoch's end, or never.",
                            ("steps", "epoch", "no"))
    save_steps: float = _f(50, "Write a checkpoint every N optimizer steps (0: only the final model; below "
                                 "1: a fraction of the steps).")
    save_total_limit: int | None = _f(2, "Checkpoints kept (oldest deleted first; null: all).")
    save_only_model: bool = _f(False, "Checkpoints hold the model only (no optimizer, schedule or RNG: they "
                               "cannot be resumed).")
    push_to_hub: bool = _f(False, "Upload the model to the Hugging Face Hub (hub_model_id) at each save and end.")
    hub_model_id: str | None = _f(None, "Hub repository, 'user/name' or 'name' (default: output_dir's name).")
    hub_token: str | None = _f(None, "Hub token (default: the logged-in one).")
    hub_private_repo: bool | None = _f(None, "Create the repository private.")
    hub_strategy: str = _f("every_save", "What is uploaded: each checkpoint and the final model, or the final "
                           "model only.", ("every_save", "end"))
    hub_revision: str | None = _f(None, "Hub branch to upload to.")
    resume: bool = _f(False, "Continue from the newest complete checkpoint in output_dir.")
    resume_from_checkpoint: str | None = _f(None, "Continue from this checkpoint directory (TRL's; train() takes "
                                            "it too).")
    damaged_checkpoint: str = _f("fall_back", "What resume does when the newest checkpoint fails its manifest's "
                                 "check (a file missing, cut short or changed): name it and fall back to the newest "
                                 "intact one, or refuse, naming both (docs/runs.md).", ("fall_back", "refuse"))
    overwrite_output_dir: bool = _f(False, "Start over in an output_dir that holds a run (transformers < 5's key): "
                                    "its checkpoints, final/, metrics and samples are deleted first. Without it, "
                                    "and without resume, such a directory is refused (docs/runs.md).")
    stop_signals: list[str] = _f(["SIGTERM", "SIGINT", "SIGUSR1"], "Signals that stop the run after its current "
                            "optimizer step with a checkpoint, exit status 75 (docs/runs.md); [] for none.")
    preset: str | None = _f(None, "Named starting point (grpo, dr_grpo, dapo, gspo, trl) for every key not set.")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from grpo.config.build import construct

        construct(self, args, kwargs)

    def __post_init__(self) -> None:
        from grpo.config.validate import resolve_and_validate

        resolve_and_validate(self)

    def __getattr__(self, name: str) -> Any:
        # TRL's keys that grpo accepts at their default only (and open-r1's reward settings) read as TRL does.
        if name.startswith("__"):
            raise AttributeError(name)
        from grpo.config.trl_keys import accepted_default

        return accepted_default(self, name)

    # -- construction from files and the command line ----------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GRPOConfig":
        return cls(**values)

    @classmethod
    def from_trl(cls, args: Any) -> "GRPOConfig":
        """A `trl.GRPOConfig` as ours: TRL's values and meaning, and TRL's defaults for what TRL has no key for."""
        from grpo.config.build import trl_values

        return cls(**trl_values(args, {f.name for f in dataclasses.fields(cls)}), preset="trl")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] = ()) -> "GRPOConfig":
        """Read a YAML recipe (or none: the defaults), apply `key=value` overrides, validate once."""
        from grpo.config.files import parse_override, read_yaml

        values: dict[str, Any] = {}
        if path is not None:
            values = read_yaml(path)
        for item in overrides:
            key, value = parse_override(item)
            values[key] = value
        return cls.from_dict(values)

    def save(self, path: str | Path) -> None:
        from grpo.config.files import plain

        Path(path).write_text(yaml.safe_dump(plain(self.to_dict()), sort_keys=False))


for _name in SCRIPT_KEYS:  # (left to ScriptArguments / ModelConfig by argument parsers)
    GRPOConfig.__dataclass_fields__[_name].init = False

