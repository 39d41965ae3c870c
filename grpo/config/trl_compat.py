"""The sections of docs/from_trl.md that are not the key tables: TRL's own test suite run against grpo (its counts and
the tests grpo does not pass, with the reason), the trainer surface TRL users' code touches, and open-r1's reward
names. grpo.config.reference writes them after the tables; the counts come from the command given in the text."""

SUITE = """\
## TRL's own test suite

TRL's `tests/test_grpo_trainer.py` (huggingface/trl at f2cd577, the newest snapshot fetched; 1.16's tag was not in
it), adapted by `scripts/adapt_trl_tests.py` into `tests/trl_suite/test_grpo_trainer.py` (import swapped; the hub's
tiny models and datasets replaced by local ones of the same architectures and columns, built by
`scripts/build_trl_test_assets.py` when the suite is collected; vision, Liger, vLLM, GPU and bitsandbytes tests and
those that drive TRL's private methods skipped with the reason). TRL's code is not committed here, so the adapted file
is made locally from a TRL checkout and kept out of git: `python scripts/adapt_trl_tests.py --trl-git TRL_GIT_DIR
--out tests/trl_suite`, then `python -m pytest -m "slow or not slow" tests/trl_suite` runs all of it (`--target trl`
writes the same file against TRL itself). CI runs grpo's own tests of the same behaviour (tests/test_trl_compat.py,
tests/test_trl_surface.py, tests/test_trl_parity.py).

Measured on the 2-core CPU machine, TRL 1.16.0, both targets run whole (`-m "slow or not slow"`, issue 41, again
after its last changes): of 175 tests, 54 skipped on both sides; **106 pass under TRL, 112 under grpo, 105 of TRL's
106** (7 pass under grpo only: `test_train_moe_peft_model`, `test_train_with_environment_owned_data`,
`test_train_with_malformed_tool_calls`, `test_train_with_mask_truncated_completions`,
`test_train_with_unknown_environment_raises` and the two environment-owned-reward tests; 8 fail on both). Counted
over all 175, skipped as not passed: TRL 106, grpo 112. No skip is grpo's alone. TRL's one that grpo does not pass:

| test | why |
|---|---|
| `test_train_with_generation_kwargs` | `num_beams: 2` with `do_sample`: TRL hands it to transformers' `generate`, which then beam-samples (keeps the 2 likeliest of the sampled continuations at each token and returns the best beam), and trains on those as if they were samples of the policy (its vLLM path has no `num_beams`: SamplingParams refuses it). Those sequences are not drawn from the policy, and their probability under the beam procedure cannot be computed, so no importance weight can correct GRPO's on-policy gradient, group statistics or ratio for it; grpo refuses it by name with that reason (raise num_generations for more completions per prompt) |

The 8 that fail on both fail for the stand-ins: the tool-calling and environment tests patch `model.generate` with
Qwen's token ids and need Qwen's chat template for TRL's response parser (grpo's engine does not call
`model.generate`); NemotronH is not built; `test_train_with_mask_truncated_completions_all_masked` expects
EOS-free random completions; `test_prepare_input_called_with_correct_data` expects the hub zen dataset's own prompts.
`test_train_with_unknown_environment_raises` fails under TRL on the stand-in's chat template (TRL's response parser
needs Qwen's); grpo raises TRL's error from `train()`, as the test expects.

The skips (tests/trl_suite/conftest.py's SKIPS, and the `require_*` markers of tests/trl_suite/trl_suite_utils.py),
each on both targets, for one of two reasons only:

| skipped | tests | why |
|---|---|---|
| `TestGRPORolloutDispatch` | 3 | reads TRL's private `_generate` by name (its dispatch, on a hand-built trainer) |
| `test_entropy_bonus_flows_gradients` | 1 | reads TRL's private `_get_per_token_logps_and_entropies` by name |
| `require_liger_kernel` tests and four Liger+PEFT tests | 21 | cannot run under TRL here: liger-kernel (a GPU) |
| `require_vision`, `TestGRPOTrainerVLM`, `test_train_with_tools_multimodal_response` | 14 | cannot run under TRL here: the hub's tiny vision-language models are not built locally |
| `TestGRPOTrainerSlow`, `require_vllm`, `require_bitsandbytes`, `require_torch_accelerator` | 14 | cannot run under TRL here: a GPU (vLLM, bitsandbytes, kernels) |
| `test_trust_remote_code` | 1 | cannot run under TRL here: the hub's remote-code model is not built locally |

## TRL's trainer surface

Besides `train()`: the last `state.log_history` entry is transformers' end-of-training summary (`train_runtime`,
`train_samples_per_second`, `train_steps_per_second`, `total_flos`, `train_loss` (the mean of every step's loss),
`epoch`, `step`, with the TRL-named metrics of the steps after the last logged one, or of the last step);
`evaluate(eval_dataset=...)` (a dataset, or a dict of them; the rewards' metrics and TRL's `eval_loss`, the
objective at ratio 1 on num_generations fresh samples per prompt, grpo.training.evaluation.eval_loss; the training loop's
evaluations leave the loss out, as it samples the set again); `get_high_entropy_mask`, `get_off_policy_mask`
(grpo.core.masks); `args`, `accelerator` and `state` (both settable), `ref_model` (None when beta is 0),
`train_dataset`, `eval_dataset`, `reward_funcs`, `reward_func_names`, `reward_weights`, `tools`,
`reward_processing_classes`, `_logs`, `entropy_coef`, `aux_loss_enabled`; `get_train_dataloader` and
`get_eval_dataloader` (TRL's rows, groups and worker rules, with transformers' `dataloader_*` settings, for code that
inspects them: train() and evaluate() do not read them); on the config, TrainingArguments' `get_process_log_level()`,
`device` and `n_gpu`; `save_model` (with LoRA the adapter, as TRL's), `push_to_hub` and `create_model_card`
(docs/runs.md), `hub_model_id`, transformers' `log_metrics`, `save_metrics`, `save_state` and `end()`;
`policy_loss` (the loss without the entropy bonus) logged with an entropy bonus; TRL's warnings (sequence-level
importance sampling with a token-summed loss; a row every reward function returned None for). With no
`train_dataset`, a GRPOTrainer given rewards, tools, environments or a rollout_func raises TRL's error (or takes its
prompts from a single environment's `reset()`, docs/agents.md); the config's task is used only when nothing else was
given (`grpo train`).

## open-r1's reward names

All 13 names of open-r1's `get_reward_funcs` run here: `accuracy`, `format`, `reasoning_steps`, `cosine`,
`repetition_penalty`, `length` (Kimi 1.5's, grpo's math_accuracy judging), `code` and `binary_code` (the `code`
reward on open-r1's `verification_info`, in grpo's sandbox), `cf_code` (open-r1's Codeforces layout: official tests,
a checker, time and memory limits, file input; Python and C++ submissions, compiled and run in grpo's sandbox, judged
as open-r1's Piston package judges them), `ioi_code` (below), `code_format`, `tag_count`, `soft_overlong_punishment`.
`benchmarks` and open-r1's `callbacks: [push_to_hub_revision]` are accepted and skipped with one line at the start.
`grpo.rewards.get_reward_funcs(script_args)` is open-r1's, with these functions. open-r1's own `src/open_r1/grpo.py`
(huggingface/open-r1@1416fa0, vendored in tests/vendor with what it imports but rewards.py) trains on its
`Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml` recipe, local model and data in place of the hub's, with two import
lines changed (`from grpo import GRPOTrainer`, `from grpo.rewards import get_reward_funcs`) and its `GRPOConfig`
over grpo's (tests/test_trl_scripts.py). Under TRL 1.16 it needs three changes that open-r1 (pinned to trl 0.18)
has not made, grpo or not: ModelConfig's `torch_dtype` is `dtype`, `trust_remote_code` moved from ModelConfig to the
training config, and trl no longer has `get_kbit_device_map`. Its `eval_dataset=dataset[test_split] if
eval_strategy != "no"` reads a test split under grpo's default eval_strategy (steps), which TRL's (no) does not.
All 5 of open-r1's GRPO recipes train a step with their keys and a local model and data (tests/test_open_r1.py:
both config_demo recipes, config_demo_code, config_codeforces, config_demo_code_ioi; vLLM, the hub, wandb,
flash-attention and Liger off, as this machine has none).

`ioi_code` (grpo/rewards/ioi.py) judges open-r1/ioi's rows (one subtask each: `id`, `test_names`, `grader_files`,
`time_limit`, `memory_limit`, `task_type`, `score_precision`, `year`) in grpo's sandbox, as open-r1's Piston
package (cms_ioi) does: the last ```cpp block with open-r1's includes, compiled with the graders (and a checker or
manager) by g++; Batch and Communication tasks (the manager and the user processes over FIFOs). The reward is
open-r1's: the subtask's minimum test score (1 per passing test, 0 per failing one, a checker's fraction), rounded
to score_precision and not scaled by the subtask's points; 0 without a ```cpp block or when it does not compile.
Unlike open-r1, a row without tests, an OutputOnly task and a sandbox failure score None (open-r1: 0).
open-r1 downloads the tests (`open-r1/ioi-test-cases`) at run time; with no network here they come from the row's
`test_cases` column (`{test_name: [input, output]}`, or a list in test_names' order; `{"input", "output"}` works
too), or from a local copy of that dataset named by the reward's `tests_dir`:
`huggingface-cli download open-r1/ioi-test-cases --repo-type dataset --local-dir DIR` once, then
`reward_funcs: [{name: ioi_code, tests_dir: DIR}, code_format, format]`. `ioi_provider` (piston or morph) is
accepted; both mean grpo's local sandbox here.
"""
