"""TRL's trainer surface beyond the documented examples: a trl.GRPOConfig as args, train(resume_from_checkpoint),
checkpoints that from_pretrained loads, a loaded reward model with its processing class, TRL's metric names, the
hub upload (refused up front without a hub; the upload path against a fake HfApi), and the TRL loss settings the
trainer wires (normalize_then_sum, sync_ref_model, the entropy terms)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.training.observe.tracking import read_metrics


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def a_reward(completions, **kwargs):
    return [float(c.count("a")) for c in completions]


def prompts(n=8):
    return Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(n)]})


def config(tmp_path, **values):
    return GRPOConfig(**{"output_dir": str(tmp_path / "run"), "num_generations": 4, "per_device_train_batch_size": 4,
                         "max_completion_length": 6, "max_steps": 2, "report_to": [], "learning_rate": 1e-2,
                         "log_completions_steps": 0, **values})


def test_a_trl_config_as_args(tiny_model_dir, tmp_path):
    trl = pytest.importorskip("trl")
    args = trl.GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, num_generations=4,
                          per_device_train_batch_size=4, max_completion_length=6, max_steps=2, report_to="none",
                          logging_steps=1, beta=0.1, loss_type="grpo", save_strategy="no")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=prompts())
    assert (trainer.cfg.beta, trainer.cfg.loss_aggregation, trainer.cfg.use_bias_correction_kl) == (
        0.1, "sequence_mean", True)
    trainer.train()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # save_strategy no


def test_checkpoints_load_with_from_pretrained_and_resume(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, save_steps=1,
                                                                                   max_steps=3),
                          train_dataset=prompts())
    trainer.train()
    path = tmp_path / "run" / "checkpoint-2"
    assert {"config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt", "trainer_state.json",
            "manifest.json"} <= {p.name for p in path.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(path)  # (the checkpoint of step 2 of 3)
    assert any(not torch.equal(v, trainer.policy.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert json.loads((path / "trainer_state.json").read_text())["global_step"] == 2

    resumed = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, save_steps=1,
                                                                                   max_steps=3),
                          train_dataset=prompts())
    resumed.train(resume_from_checkpoint=str(path))  # a path: from step 2 to 3, as the first run went
    for k, v in trainer.policy.state_dict().items():
        assert torch.equal(resumed.policy.state_dict()[k], v), k
    assert [r["step"] for r in resumed.state.log_history] == [1, 2, 3, 3]  # (3 twice: the step, the summary)
    assert "train_runtime" in resumed.state.log_history[-1]
    again = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, max_steps=3),
                        train_dataset=prompts())
    again.train(resume_from_checkpoint=True)  # the newest: step 3, nothing left to train
    assert again.step == 3
    with pytest.raises(ConfigError, match="resume_from_checkpoint: .* is not a complete checkpoint"):
        again.train(resume_from_checkpoint=str(tmp_path))


def test_the_last_step_is_checkpointed_so_a_finished_run_resumes_at_its_end(tiny_model_dir, tmp_path):
    """transformers' Trainer saves at the last step under a steps strategy (DefaultFlowCallback): save_steps 50
    over a 2-step run still leaves checkpoint-2, and resuming the finished run trains nothing more."""
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, save_steps=50),
                          train_dataset=prompts())
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2"]
    logged = [r["step"] for r in read_metrics(tmp_path / "run") if "reward" in r]
    assert logged == [1, 2]

    again = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, save_steps=50),
                        train_dataset=prompts())
    again.train(resume_from_checkpoint=True)
    assert again.step == 2
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "reward" in r] == logged  # no step redone
    for k, v in trainer.policy.state_dict().items():
        assert torch.equal(again.policy.state_dict()[k], v), k


def test_a_loaded_reward_model_with_its_processing_class(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=1, num_labels=1,
                                                       pad_token_id=tokenizer.pad_token_id))
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=model, reward_processing_classes=tokenizer,
                          args=config(tmp_path, max_steps=1, log_completions_steps=1), train_dataset=prompts())
    metrics = trainer.train_step()
    # As TRL scores a text pair: the model's logit on prompt + completion (without special tokens)
    with torch.inference_mode():
        want = [float(model(**tokenizer(s["prompt"] + s["completion"], return_tensors="pt",
                                        add_special_tokens=False)).logits[0, 0]) for s in trainer.loop.last_samples]
    assert len(want) == 4
    assert metrics[f"reward/{trainer.reward_names[0]}"] == pytest.approx(sum(want) / 4, rel=1e-5)


@pytest.mark.parametrize("mode", ["both", "trl", "grpo"])
def test_metric_names(tiny_model_dir, tmp_path, mode):
    GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, max_steps=1, metric_names=mode),
                train_dataset=prompts()).train()
    row = read_metrics(tmp_path / "run")[0]
    trl_names = {"reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
                 "entropy", "grad_norm", "learning_rate", "loss", "num_tokens", "rewards/a_reward/mean"}
    ours = {"reward/total", "policy/entropy", "train/grad_norm", "reward/a_reward"}
    assert (trl_names <= set(row)) == (mode != "grpo") and (ours <= set(row)) == (mode != "trl")


def test_tensorboard_holds_trls_keys_where_transformers_puts_them(tiny_model_dir, tmp_path):
    """The dashboards get TRL's keys as transformers' Trainer.log writes them (train/<key>; its rewrite_logs), in
    output_dir/runs/<date>_<host>/; a metric TRL does not have keeps our name, under train/ too."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=prompts(),
                args=config(tmp_path, report_to=["tensorboard"])).train()
    (events,) = (tmp_path / "run" / "runs").iterdir()
    acc = accumulator.EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/reward", "train/entropy", "train/rewards/a_reward/mean", "train/completions/mean_length",
            "train/kl", "train/loss", "train/grad_norm", "train/learning_rate"} <= tags
    assert not {"train/reward/total", "train/policy/entropy", "reward/total"} & tags  # (TRL's names only, once)
    row = read_metrics(tmp_path / "run")[-2]  # metrics.jsonl keeps both names (metric_names: both)
    assert [v for _, v in ((e.step, e.value) for e in acc.Scalars("train/reward"))] == pytest.approx(
        [r["reward/total"] for r in read_metrics(tmp_path / "run") if "reward/total" in r])
    assert "reward/total" in row and "reward" in row


def test_dashboard_names_follow_transformers_rewrite_logs():
    from grpo.training.observe.metric_names import dashboard_names

    logs = {"reward/total": 0.5, "reward": 0.5, "reward/f": 0.25, "rewards/f/mean": 0.25, "train/loss": 1.0,
            "loss": 1.0, "health/x": 3.0, "eval/accuracy": 0.1, "eval_accuracy": 0.1}
    assert dashboard_names(logs, "both", ["f"]) == {"train/reward": 0.5, "train/rewards/f/mean": 0.25,
                                                    "train/loss": 1.0, "train/health/x": 3.0, "eval/accuracy": 0.1}
    assert dashboard_names({"reward/total": 0.5, "eval/accuracy": 0.1}, "grpo", ["f"]) == {
        "train/reward/total": 0.5, "eval/accuracy": 0.1}
    # TRL's tool metrics: calls per completion, failed calls per call (grpo.agents.metrics computes both)
    from grpo.training.observe.metric_names import named

    assert named({"tools/calls_per_completion": 0.5, "tools/failure_frac": 0.25, "moe/aux_loss": 0.1}, "trl", []) == {
        "tools/call_frequency": 0.5, "tools/failure_frequency": 0.25, "aux_loss": 0.1}  # (TRL's MoE aux_loss)


def test_dataloaders_as_trls(tiny_model_dir, tmp_path):
    """get_train_dataloader: a rollout's rows per batch (per_device_train_batch_size x steps_per_generation), each
    prompt num_generations times in a row, TRL's num_workers; get_eval_dataloader: the eval rows in order, G times
    each, per_device_eval_batch_size per batch; an iterable eval set is read by one worker for that loader only."""
    from datasets import IterableDataset

    data = prompts(8)
    evals = Dataset.from_dict({"prompt": ["e0\n", "e1\n", "e2\n"]})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=data, eval_dataset=evals,
                          args=config(tmp_path, dataloader_num_workers=2, steps_per_generation=2,
                                      per_device_eval_batch_size=6))
    loader = trainer.get_train_dataloader()
    assert loader.num_workers == 2 and trainer.args.dataloader_num_workers == 2
    batch = next(iter(loader))
    assert len(batch) == 8  # 4 per micro-batch x 2 steps_per_generation (one process)
    assert [r["prompt"] for r in batch[:4]] == [batch[0]["prompt"]] * 4 and batch[4]["prompt"] != batch[0]["prompt"]
    assert sorted({r["prompt"] for b in loader for r in b}) == sorted(data["prompt"])  # every prompt, once a group
    (first, second) = list(trainer.get_eval_dataloader())
    assert [r["prompt"] for r in first + second] == [p for p in evals["prompt"] for _ in range(4)]
    stream = IterableDataset.from_generator(lambda: iter([{"prompt": "s\n"}]))
    streamed = trainer.get_eval_dataloader(stream)
    assert streamed.num_workers == 0 and [r["prompt"] for b in streamed for r in b] == ["s\n"] * 4
    assert trainer.args.dataloader_num_workers == 2  # (scoped to that loader, as TRL)


def test_dataloaders_take_transformers_settings(tiny_model_dir, tmp_path):
    """The dataloader_* keys reach get_train_dataloader's and get_eval_dataloader's DataLoader as transformers'
    Trainer passes them. drop_last: 3 eval prompts x G=4 = 12 rows in batches of 5 make 2 batches (3 without)."""
    evals = Dataset.from_dict({"prompt": ["e0\n", "e1\n", "e2\n"]})
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=prompts(8), eval_dataset=evals,
                          args=config(tmp_path, dataloader_num_workers=2, dataloader_pin_memory=False,
                                      dataloader_persistent_workers=True, dataloader_prefetch_factor=3,
                                      dataloader_drop_last=True, per_device_eval_batch_size=5))
    train, evaluation = trainer.get_train_dataloader(), trainer.get_eval_dataloader()
    for loader in (train, evaluation):
        assert (loader.num_workers, loader.pin_memory, loader.persistent_workers) == (2, False, True)
        assert (loader.prefetch_factor, loader.drop_last) == (3, True)
    assert len(evaluation) == 2
    trainer.args.dataloader_drop_last = False  # (settable, as on TrainingArguments)
    assert len(trainer.get_eval_dataloader()) == 3


def test_an_iterable_train_set_with_dispatch_batches_gets_trls_error(tiny_model_dir, tmp_path):
    from datasets import IterableDataset

    stream = IterableDataset.from_generator(lambda: iter([{"prompt": f"q{i}\n"} for i in range(8)]))
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`, but it is set to"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=stream,
                    args=config(tmp_path, accelerator_config={"dispatch_batches": True}))


def test_accelerator_is_settable_and_reward_func_names(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[a_reward, length_reward], train_dataset=prompts(),
                          args=config(tmp_path))
    assert trainer.reward_func_names == ["a_reward", "length_reward"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0] and trainer.reward_weights.dtype == torch.float32
    other = SimpleNamespace(num_processes=1)
    trainer.accelerator = other
    assert trainer.accelerator is other


class FakeHub:
    """huggingface_hub.HfApi's calls the uploader makes, recorded."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def whoami(self):
        if self.fail:
            raise self.fail
        return {"name": "someone"}

    def create_repo(self, repo_id, private=None, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private))

    def create_branch(self, repo_id, branch, exist_ok=False):
        self.calls.append(("create_branch", repo_id, branch))

    def upload_folder(self, repo_id, folder_path, revision, commit_message, ignore_patterns):
        files = sorted(p.name for p in Path(folder_path).iterdir() if p.is_file())
        self.calls.append(("upload", repo_id, revision, commit_message, files, ignore_patterns))


def test_push_to_hub_is_refused_up_front_when_no_hub_answers(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there; this machine has no hub anyway
    loaded = []
    monkeypatch.setattr("grpo.training.trainer.load_model", lambda *a: loaded.append(1))
    with pytest.raises(ConfigError, match=r"push_to_hub: the Hugging Face Hub cannot be reached or refuses the token"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, args=config(tmp_path, push_to_hub=True),
                    train_dataset=prompts())
    assert loaded == []  # before the model loads


def test_push_to_hub_uploads_each_save_and_the_final_model(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub

    hub = FakeHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda token=None: hub)
    GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=prompts(),
                args=config(tmp_path, push_to_hub=True, hub_model_id="tiny-grpo", hub_revision="exp1",
                            hub_private_repo=True, save_steps=1)).train()
    assert hub.calls[:2] == [("create_repo", "someone/tiny-grpo", True), ("create_branch", "someone/tiny-grpo", "exp1")]
    uploads = [c for c in hub.calls if c[0] == "upload"]
    assert [c[3] for c in uploads] == ["grpo: checkpoint at step 1", "grpo: checkpoint at step 2",
                                       "grpo: model after 2 steps"]  # (transformers: the last step saves too)
    assert all(c[1:3] == ("someone/tiny-grpo", "exp1") and "model.safetensors" in c[4] for c in uploads)
    assert "trainer_state.pt" in uploads[0][5]  # (left out: optimizer and RNG states stay local)


def test_hub_strategy_end_uploads_the_final_model_only(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub

    hub = FakeHub()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda token=None: hub)
    GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=prompts(),
                args=config(tmp_path, push_to_hub=True, hub_strategy="end", save_steps=1)).train()
    assert [c[3] for c in hub.calls if c[0] == "upload"] == ["grpo: model after 2 steps"]
    assert hub.calls[0] == ("create_repo", "someone/run", None)  # default: the output directory's name


class LocalHub:
    """huggingface_hub.HfApi over a local directory (no network): upload_folder copies what the real one would
    upload (its own ignore_patterns filter) to root/<repo_id>/, which from_pretrained then reads back."""

    def __init__(self, root: Path):
        self.root = root

    def whoami(self):
        return {"name": "someone"}

    def create_repo(self, repo_id, private=None, exist_ok=False):
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)

    def upload_folder(self, repo_id, folder_path, commit_message, revision=None, ignore_patterns=None,
                      run_as_future=False):
        import shutil

        from huggingface_hub.utils import filter_repo_objects

        folder = Path(folder_path)
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        for name in filter_repo_objects(files, ignore_patterns=ignore_patterns):
            (self.root / repo_id / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(folder / name, self.root / repo_id / name)
        return f"{repo_id}: {commit_message}"


def test_push_to_hub_with_a_model_card_to_a_local_hub_and_back(tiny_model_dir, tmp_path, monkeypatch):
    """TRL's script's last lines: train, save_model, push_to_hub(dataset_name=...) (push_to_hub not set in the
    config: the repository is made then). The hub holds the model, its tokenizer and a model card with TRL's
    fields; checkpoints and grpo's local files stay home."""
    import huggingface_hub
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    hub = LocalHub(tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda token=None: hub)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=a_reward, train_dataset=prompts(),
                          args=config(tmp_path, hub_model_id="tiny-grpo"))
    trainer.train()
    trainer.policy.config._name_or_path = "Qwen/Qwen2-0.5B"  # (as a hub model would name its base)
    assert trainer.push_to_hub(dataset_name="trl-lib/DeepMath-103K") == "someone/tiny-grpo: End of training"
    assert trainer.hub_model_id == "someone/tiny-grpo"

    repo = tmp_path / "hub" / "someone" / "tiny-grpo"
    back = AutoModelForCausalLM.from_pretrained(repo)
    for k, v in trainer.policy.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert (repo / "tokenizer.json").exists() and (repo / "metrics.jsonl").exists()
    assert not [p for p in repo.iterdir() if p.name.startswith(("checkpoint-", "final", "."))]
    card = ModelCard.load(repo / "README.md")
    assert card.data.base_model == "Qwen/Qwen2-0.5B" and card.data.datasets == "trl-lib/DeepMath-103K"  # (as TRL)
    assert {"trl", "grpo", "generated_from_trainer"} <= set(card.data.tags) and card.data.model_name == "tiny-grpo"
    assert "@article{shao2024deepseekmath" in card.text and "huggingface.co/papers/2402.03300" in card.text
    last = [r for r in read_metrics(tmp_path / "run") if "reward" in r][-1]
    assert f"| reward | {last['reward']:.6g} |" in card.text  # the last logged step's metrics, TRL's names


# ---- the TRL loss settings through the trainer -------------------------------------------------------------------
class Scripted:
    """Rows write these texts in turn (the byte tokenizer: a token per character), then EOS."""

    TEXTS = ["a", "bb", "aab", "ba", "ab", "a", "bab", "aa"]

    def __init__(self, tokenizer):
        self.ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in self.TEXTS]

    def generate(self, prompt_ids, params, seeds):
        ids = [self.ids[i % len(self.ids)] for i in range(len(prompt_ids))]
        return SimpleNamespace(ids=ids, truncated=[False] * len(ids), logprobs=None)


def scripted(model_dir, tmp_path, rewards, **values):
    from transformers import AutoTokenizer

    return GRPOTrainer(model=model_dir, reward_funcs=rewards, args=config(tmp_path, **values),
                       train_dataset=prompts(), generator=Scripted(AutoTokenizer.from_pretrained(model_dir)))


def test_normalize_then_sum_gives_decoupled_advantages(tiny_model_dir, tmp_path):
    from grpo.core import decoupled_advantages

    trainer = scripted(tiny_model_dir, tmp_path, [a_reward, length_reward], prompts_per_step=2, reward_weights=[1, 0.5],
                       multi_objective_aggregation="normalize_then_sum")
    batch = trainer.rollout()
    texts = Scripted.TEXTS
    rewards = torch.tensor([[t.count("a"), len(t)] for t in texts], dtype=torch.float32).view(2, 4, 2)
    torch.testing.assert_close(batch.advantages, decoupled_advantages(rewards, torch.tensor([1.0, 0.5])).view(-1))


def test_sync_ref_model_mixes_the_reference(tiny_model_dir, tmp_path):
    trainer = scripted(tiny_model_dir, tmp_path, a_reward, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2,
                       ref_model_mixup_alpha=0.6, reference_weights="disk")
    start = {k: v.clone() for k, v in trainer.reference.state_dict().items()}
    trainer.train_step()
    trainer.step += 1
    assert all(torch.equal(v, start[k]) for k, v in trainer.reference.state_dict().items())  # step 1: not yet
    trainer.train_step()  # step 2: ref = 0.6 policy + 0.4 ref
    for k, v in trainer.reference.state_dict().items():
        torch.testing.assert_close(v, 0.6 * trainer.policy.state_dict()[k] + 0.4 * start[k])


def test_entropy_bonus_changes_the_gradient_by_the_entropy_term(tiny_model_dir, tmp_path):
    """The trainer's entropy bonus: its gradient equals -coef * d(mean entropy) on top of the surrogate's."""
    from grpo.engines.head import token_entropy

    norms = {}
    for coef in (0.0, 0.5):
        trainer = scripted(tiny_model_dir, tmp_path / str(coef), a_reward, entropy_coef=coef, max_grad_norm=0,
                           prompts_per_step=2)
        batch = trainer.rollout()
        grads = {}
        real = trainer._optimizer_step

        def capture(b, t=trainer):
            grads.update({k: p.grad.clone() for k, p in t.policy.named_parameters() if p.grad is not None})
            return real(b)

        trainer._optimizer_step = capture
        metrics = trainer.update(batch)
        norms[coef] = grads
    # d/dtheta of -0.5 * mean entropy, by hand on a fresh copy of the initial model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    T = batch.completion_mask.shape[1]
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=positions).logits
    entropy = token_entropy(logits[:, -T - 1:-1])
    mask = batch.completion_mask.bool()
    # two micro-batches of 4 rows: TRL's bonus is the mean of the micro-batches' token means
    bonus = sum(-0.5 * entropy[r][mask[r]].mean() / 2 for r in (slice(0, 4), slice(4, 8)))
    bonus.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(norms[0.5][name] - norms[0.0][name], p.grad, rtol=1e-3, atol=1e-6)
    assert "policy/entropy_coef" in metrics
