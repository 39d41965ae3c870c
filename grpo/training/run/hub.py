"""Uploading the model to the Hugging Face Hub (push_to_hub, hub_model_id, hub_strategy, hub_revision, ...).

The repository is made (or found) before training starts, so a hub that cannot be reached, or a missing login,
stops the run up front with the reason instead of after hours of training. hub_strategy every_save uploads the
model files of each checkpoint as it is written and final/ at the end; end uploads final/ only. Trainer state files
(optimizer, RNG) stay local. Uploads go through `huggingface_hub.HfApi`.
"""

from __future__ import annotations

from pathlib import Path

from grpo.config import ConfigError

LOCAL_ONLY = ["trainer_state.pt", "manifest.json", "*.tmp"]


class HubUploader:
    def __init__(self, cfg, api=None, token: str | None = None):
        import huggingface_hub

        self.cfg = cfg
        self.api = api if api is not None else huggingface_hub.HfApi(token=token or cfg.hub_token)
        self.repo_id = cfg.hub_model_id or Path(cfg.output_dir).resolve().name

    def start(self) -> None:
        """Check the hub answers and the token is valid, then make the repository (and branch); a ConfigError says
        why it cannot."""
        import os

        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise ConfigError("push_to_hub: HF_HUB_OFFLINE is set, so nothing can be uploaded; set push_to_hub=false "
                              "(and upload final/ later), or unset HF_HUB_OFFLINE.")
        try:
            user = self.api.whoami()
        except Exception as err:  # noqa: BLE001 - connection errors, HTTP errors and a missing token all stop here
            raise ConfigError(f"push_to_hub: the Hugging Face Hub cannot be reached or refuses the token "
                              f"({type(err).__name__}: {str(err)[:160]}); log in (`hf auth login`) or set hub_token, "
                              "or set push_to_hub=false and upload final/ later.") from None
        if "/" not in self.repo_id and isinstance(user, dict) and user.get("name"):
            self.repo_id = f"{user['name']}/{self.repo_id}"
        self.api.create_repo(self.repo_id, private=self.cfg.hub_private_repo, exist_ok=True)
        if self.cfg.hub_revision:
            self.api.create_branch(self.repo_id, branch=self.cfg.hub_revision, exist_ok=True)

    def upload(self, folder: Path, message: str) -> None:
        self.api.upload_folder(repo_id=self.repo_id, folder_path=str(folder), revision=self.cfg.hub_revision,
                               commit_message=message, ignore_patterns=LOCAL_ONLY)

    def saved(self, checkpoint: Path, step: int) -> None:
        if self.cfg.hub_strategy == "every_save":
            self.upload(checkpoint, f"grpo: checkpoint at step {step}")

    def finished(self, final: Path, step: int) -> None:
        self.upload(final, f"grpo: model after {step} steps")


def start_hub(cfg, token: str | None = None) -> HubUploader:
    """The run's uploader, its repository made: called before the model loads, so a hub that cannot be reached
    stops the run at once."""
    uploader = HubUploader(cfg, token=token)
    uploader.start()
    return uploader


# ---- trainer.push_to_hub(): TRL's (transformers') call, with TRL's model card ----------------------------------------
PUSH_IGNORED = ["_*", ".*", "checkpoint-*", "final*", "nonfinite*", *LOCAL_ONLY]
"""What push_to_hub leaves out of output_dir: transformers' `_*` and `checkpoint-*`, and grpo's own local files
(final/ is the same model as output_dir's after save_model; the lock; non-finite dumps)."""

METHOD = {"name": "GRPO", "title": "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
          "id": "2402.03300", "citation": """@article{shao2024deepseekmath,
    title        = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
    author       = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang
                    and Y. K. Li and Y. Wu and Daya Guo},
    year         = 2024,
    eprint       = {arXiv:2402.03300},
}"""}  # (TRL's GRPOTrainer._paper)


def model_card(base_model: str | None, model_name: str, hub_model_id: str, dataset_name: str | None,
               tags: list[str], metrics: dict[str, float]):
    """A `huggingface_hub.ModelCard` with TRL's fields (trl/templates/lm_model_card.md: base model, dataset, tags,
    the method and its citation) and the last logged metrics."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(base_model=base_model, datasets=dataset_name, library_name="transformers",
                         model_name=model_name, tags=["generated_from_trainer", *tags])
    base = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a model"
    on = f" on the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}) dataset" if dataset_name else ""
    rows = "".join(f"| {k} | {v:.6g} |\n" for k, v in metrics.items())
    return ModelCard(
        f"---\n{data.to_yaml()}\n---\n\n# Model Card for {model_name}\n\nThis model is a fine-tuned version of "
        f"{base}{on}.\nIt has been trained with grpo (TRL's GRPOTrainer interface).\n\n## Quick start\n\n```python\n"
        f"from transformers import pipeline\n\ngenerator = pipeline(\"text-generation\", model=\"{hub_model_id}\")\n"
        "```\n\n## Training procedure\n\nThis model was trained with GRPO, a method introduced in "
        f"[{METHOD['title']}](https://huggingface.co/papers/{METHOD['id']}).\n\n"
        + (f"### Metrics (last logged step)\n\n| metric | value |\n|---|---|\n{rows}\n" if rows else "")
        + f"## Citations\n\nCite GRPO as:\n\n```bibtex\n{METHOD['citation']}\n```\n")
