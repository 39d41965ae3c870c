"""Vision-language GRPO on the shipped tiny Qwen2-VL-shaped model (grpo/assets/tiny-vision) and the `shapes` task:
per-row pixel features through generation, micro-batches and the update; image tokens kept out of completions and
of the loss; the data's forms and the refusals."""

from __future__ import annotations

import random

import pytest
import torch

from grpo.config import ConfigError, GRPOConfig
from grpo.engines.base import SamplingParams
from grpo.engines.images import model_inputs, split_rows, vision_token_ids
from grpo.engines.policy import completion_logprobs
from grpo.engines.sampling import TransformersSampler
from grpo.tasks import get_task
from grpo.tasks.shapes import COLOURS, Scene, draw
from grpo.training.data.prompts import render_prompt
from grpo.training.rollout.batch import pack
from grpo.training.data.vision import (ImageProcessing, check_image_tokens_masked, load_image, vision_prompts,
                                  with_image_parts)
from vision_families import microbatched_logprobs

ASSET = "grpo/assets/tiny-vision"


@pytest.fixture(scope="module")
def vlm():
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(ASSET).eval()
    tok = AutoTokenizer.from_pretrained(ASSET)
    return model, tok, ImageProcessing(tok, AutoImageProcessor.from_pretrained(ASSET))


def prompt_rows(processing, n: int, seed: int = 0):
    """n shapes prompts: (their token ids, their RowImages)."""
    rows = get_task("shapes").make_rows("train", n, seed)
    render = lambda m: render_prompt(m, processing.tokenizer, GRPOConfig(), "")  # noqa: E731
    ids, images = vision_prompts([r["prompt"] for r in rows], {"image": [r["image"] for r in rows]}, processing,
                                 render, None)
    pixels, grids = processing.features([im for row in images for im in row])
    return ids, split_rows(pixels, grids, [len(row) for row in images])


def test_split_rows_cuts_patches_by_each_images_grid():
    """Grids (1,2,2), (1,1,2), (1,2,2) hold 4, 2 and 4 patches (t*h*w); rows of 2 and 1 images take patches 0-5 and
    6-9, and the grids of their own images."""
    pixels = torch.arange(10.0)[:, None].expand(10, 3)
    grids = torch.tensor([[1, 2, 2], [1, 1, 2], [1, 2, 2]])
    rows = split_rows(pixels, grids, [2, 1])
    assert rows[0].pixel_values[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert rows[1].pixel_values[:, 0].tolist() == [6, 7, 8, 9]
    assert rows[0].image_grid_thw.tolist() == [[1, 2, 2], [1, 1, 2]] and rows[1].image_grid_thw.tolist() == [[1, 2, 2]]
    with pytest.raises(ValueError, match="grids name 10 patches"):
        split_rows(pixels[:9], grids, [2, 1])


def test_shapes_rows_are_seeded_split_and_drawn_as_described():
    task = get_task("shapes")
    a, b = task.make_rows("train", 20, 3), task.make_rows("train", 20, 3)
    assert [r["answer"] for r in a] == [r["answer"] for r in b] and a[0]["image"].tobytes() == b[0]["image"].tobytes()
    assert all(1 <= int(r["answer"]) <= 4 for r in a)
    test = task.make_rows("test", 50, 0)
    assert len({(r["prompt"][0]["content"], r["image"].tobytes()) for r in test}) == 50  # distinct held-out rows
    # A red square in cell 5 (row 1, col 1: pixels 19..28) and a blue circle in cell 10 (row 2, col 2): their
    # centres have their colours, the background is white.
    image = draw(Scene(((5, "red", "square"), (10, "blue", "circle"))))
    assert image.getpixel((23, 23)) == COLOURS["red"] and image.getpixel((39, 39)) == COLOURS["blue"]
    assert image.getpixel((0, 0)) == (255, 255, 255)


def test_prompt_has_as_many_image_tokens_as_the_image_has_merged_patches(vlm):
    """A 64x64 picture in 8-pixel patches is an 8x8 grid; a 2x2 merge makes 16 image tokens."""
    model, tok, processing = vlm
    ids, images = prompt_rows(processing, 2)
    assert images[0].image_grid_thw.tolist() == [[1, 8, 8]]
    assert ids[0].count(model.config.image_token_id) == 16


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sampled_logprobs_equal_a_forward_of_the_same_rows(vlm, lora):
    """Generation carries each row's pixels and M-RoPE positions: the sampler's log-probs of its tokens equal those of
    one padded forward over prompt + completion (left-padded prompts of different images and lengths), under the
    distribution it samples from: the vision tokens banned (-inf), the rest renormalized. Under a LoRA wrapper too
    (the rows' position offsets are found inside it)."""
    model, tok, processing = vlm
    if lora:
        import copy

        from peft import LoraConfig, get_peft_model

        model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False))
    ids, images = prompt_rows(processing, 3)
    ids[1] = ids[1] + [ids[1][-1]] * 3  # prompts of different lengths: left padding differs per row
    rows = [i for i in range(3) for _ in range(2)]
    prompt_ids, row_images = [ids[i] for i in rows], [images[i] for i in rows]
    sampler = TransformersSampler(model, tok.pad_token_id, [tok.eos_token_id])
    out = sampler.generate(prompt_ids, SamplingParams(max_new_tokens=6), list(range(6)), images=row_images)
    input_ids, attention, mask = pack(prompt_ids, out.ids, tok.pad_token_id, [True] * 6)
    T = mask.shape[1]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention,
                       **model_inputs(row_images, input_ids, model.config)).logits[:, -T - 1:-1]
    logits = logits.clone()
    logits[..., vision_token_ids(model.config)] = float("-inf")
    forward = logits.log_softmax(-1).gather(2, input_ids[:, -T:, None])[..., 0]
    sampled = torch.zeros_like(forward)
    for r, lp in enumerate(out.logprobs):
        sampled[r, :len(lp)] = torch.tensor(lp)
    torch.testing.assert_close(forward * mask, sampled * mask, atol=2e-4, rtol=1e-4)
    # The update's pass (the whole vocabulary) differs from it only by the banned tokens' share.
    full = completion_logprobs(model, input_ids, attention, T, 1.0, images=row_images)
    assert ((full - forward) * mask).abs().max() < 0.05


def test_micro_batched_rows_take_their_own_pixels(vlm):
    """Log-probs of rows cut into micro-batches of 2, in a shuffled order, equal one plain forward of each row alone
    with its own image; with the images swapped between rows they differ (the check can fail)."""
    model, tok, processing = vlm
    ids, images = prompt_rows(processing, 4, seed=1)
    gen = torch.Generator().manual_seed(0)
    completions = [torch.randint(0, 260, (k,), generator=gen).tolist() for k in (3, 5, 2, 4)]
    got, input_ids, attention, mask = microbatched_logprobs(model, tok.pad_token_id, ids, completions, images)
    with torch.no_grad():
        for r in range(4):
            row = torch.tensor([ids[r] + completions[r]])
            logits = model(input_ids=row, **model_inputs([images[r]], row, model.config)).logits[0, :-1]
            plain = logits.log_softmax(-1)[-len(completions[r]):].gather(1, row[0, -len(completions[r]):, None])[:, 0]
            torch.testing.assert_close(got[r, :len(completions[r])], plain, atol=1e-5, rtol=1e-5)
        swapped = completion_logprobs(model, input_ids, attention, mask.shape[1], 1.0, images=images[::-1])
    assert (swapped - got).abs().max() > 1e-3


def test_image_tokens_are_never_sampled(vlm):
    """With the head pushed towards the image token (+50 to its logit), every draw would be one; the sampler bans
    the vision tokens, so no completion holds one."""
    model, tok, processing = vlm
    ids, images = prompt_rows(processing, 2)
    image_id = model.config.image_token_id

    def favour_image(module, args, output):
        output[..., image_id] += 50.0
        return output

    handle = model.lm_head.register_forward_hook(favour_image)
    try:
        with torch.no_grad():
            row = torch.tensor([ids[0]])
            assert model(input_ids=row, **model_inputs([images[0]], row, model.config)).logits[0, -1].argmax() == image_id
        out = TransformersSampler(model, tok.pad_token_id, [tok.eos_token_id]).generate(
            ids, SamplingParams(max_new_tokens=5), [0, 1], images=images)
    finally:
        handle.remove()
    banned = {image_id, model.config.video_token_id, model.config.vision_start_token_id, model.config.vision_end_token_id}
    assert all(t not in banned for c in out.ids for t in c) and all(out.ids)


def test_an_image_token_under_the_loss_mask_is_an_error():
    ids = torch.tensor([[5, 9, 7, 8]])  # prompt [5, 9], completion [7, 8]; 9 is the image token
    check_image_tokens_masked(ids, torch.tensor([[1.0, 1.0]]), image_token_id=9)  # in the prompt: fine
    with pytest.raises(RuntimeError, match="image token entered the loss mask"):
        check_image_tokens_masked(torch.tensor([[5, 7, 9, 8]]), torch.tensor([[1.0, 1.0]]), image_token_id=9)


def test_image_column_forms_and_image_parts(tmp_path):
    """TRL's forms: a PIL image, a path, a datasets.Image dict; text prompts get image parts before their text."""
    image = draw(Scene(((0, "green", "square"),)))
    image.save(tmp_path / "a.png")
    for value in (image, str(tmp_path / "a.png"), {"bytes": (tmp_path / "a.png").read_bytes(), "path": None}):
        assert load_image(value, 0).tobytes() == image.tobytes()
    with pytest.raises(ConfigError, match="dataset row 3: the image is a int"):
        load_image(7, 3)
    assert with_image_parts("How many?", 2)[0]["content"] == [{"type": "image"}, {"type": "image"},
                                                               {"type": "text", "text": "How many?"}]


def vision_config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(model_name_or_path="tiny-vision", task="shapes", output_dir=str(tmp_path / "run"), max_steps=2,
                  num_generations=4, per_device_train_batch_size=4, max_completion_length=6, learning_rate=3e-3,
                  beta=0.04, report_to=[], save_strategy="no", disable_tqdm=True, eval_strategy="no")
    return GRPOConfig(**{**values, **overrides})


def larger_answer(completions, **kwargs):
    """The first digit of the completion (0 without one): spread inside a group whose sampled counts differ."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(next((ch for ch in t if ch.isdigit()), "0")) for t in texts]


def test_a_few_steps_on_the_tiny_vision_model_change_the_language_and_vision_weights(tmp_path):
    from grpo.training.trainer import GRPOTrainer

    data = get_task("shapes").dataset("train", n=16)
    trainer = GRPOTrainer(args=vision_config(tmp_path, log_completions_steps=1), reward_funcs=larger_answer,
                          train_dataset=data)
    assert trainer.engine.name == "transformers" and "vision-language" in trainer.engine.reason
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    trainer.train()
    after = trainer.policy.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any(k.startswith("model.visual.") for k in changed)  # the pixels reached the loss's gradient
    assert any(k.startswith("model.language_model.") for k in changed)
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(tmp_path / "run" / "final")
    assert (tmp_path / "run" / "final" / "preprocessor_config.json").exists()
    check_samples_show_their_pictures(tmp_path / "run", data)


def check_samples_show_their_pictures(run, data) -> None:
    """Each sample row names its picture, a PNG under samples/images/ holding exactly the pixels of its row's image
    (the row found by its question among the rows whose picture matches)."""
    import json

    import numpy as np
    from PIL import Image

    rows = [json.loads(line) for line in (run / "samples" / "step_000001.jsonl").read_text().splitlines()]
    assert rows and all(len(r["images"]) == 1 for r in rows)
    pictures = {(r["prompt"][-1]["content"], np.asarray(r["image"]).tobytes()) for r in data}
    for r in rows:
        png = np.asarray(Image.open(run / r["images"][0]).convert("RGB"))
        assert png.shape == (64, 64, 3) and (r["prompt"], png.tobytes()) in pictures


def test_vision_refusals(tmp_path):
    from grpo.training.trainer import GRPOTrainer

    with pytest.raises(ConfigError, match="engine: 'cpu'.*vision-language model"):
        GRPOTrainer(args=vision_config(tmp_path, engine="cpu"), train_dataset=get_task("shapes").dataset("train", n=8))
    with pytest.raises(ConfigError, match="use_vllm: vLLM's multimodal inputs are not wired yet"):
        GRPOTrainer(args=vision_config(tmp_path, use_vllm=True), train_dataset=get_task("shapes").dataset("train", n=8))
    with pytest.raises(ConfigError, match="the data has images, but the model is not a vision-language model"):
        GRPOTrainer(args=vision_config(tmp_path, model_name_or_path="tiny-arith"),
                    train_dataset=get_task("shapes").dataset("train", n=8))


def test_a_checkpoint_inside_a_rollout_keeps_its_rows_pixels_and_resumes_exactly(tmp_path):
    """num_iterations 2: the rollout of step 1 feeds step 2 too, so step 1's checkpoint keeps it, pixels included;
    stopped after step 1 and resumed, the run ends on the uninterrupted run's weights, bit for bit."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from grpo.training.trainer import GRPOTrainer

    class StopAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 1

    data = get_task("shapes").dataset("train", n=16)
    settings = dict(num_iterations=2, save_steps=1, save_strategy="steps", seed=3)
    GRPOTrainer(args=vision_config(tmp_path / "a", **settings), reward_funcs=larger_answer, train_dataset=data).train()
    GRPOTrainer(args=vision_config(tmp_path / "b", **settings), reward_funcs=larger_answer, train_dataset=data,
                callbacks=[StopAfterFirstStep()]).train()
    resumed = GRPOTrainer(args=vision_config(tmp_path / "b", **settings), reward_funcs=larger_answer,
                          train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.loop.pending is not None and resumed.loop.pending[0].images is not None  # (the kept rollout fed step 2)
    straight, again = (load_file(str(tmp_path / d / "run" / "final" / "model.safetensors")) for d in "ab")
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)


def test_trls_vlm_example_runs_with_the_tiny_model_and_shapes(tmp_path):
    """TRL's examples/scripts/grpo_vlm.py, its trainer call as written: TRL's GRPOConfig, a model path, a
    [system, user] conversation with the picture in an `image` column and the answer in `solution`, TRL's
    think_format_reward beside an accuracy reward; then save_model. The hub model and dataset are swapped for
    tiny-vision and shapes rows with the example's columns."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from trl.rewards import think_format_reward

    from grpo import GRPOTrainer

    system = "A conversation between user and assistant. The user asks a question, and the assistant solves it."
    rows = get_task("shapes").make_rows("train", 8, 0)
    dataset = Dataset.from_list([{"problem": r["prompt"][0]["content"], "image": r["image"], "solution": r["answer"]}
                                 for r in rows])
    dataset = dataset.map(lambda example: {"prompt": [{"role": "system", "content": system},
                                                      {"role": "user", "content": example["problem"]}]})

    def accuracy_reward(completions, solution: list[str], **kwargs):
        return [float(c[0]["content"].strip() == f"<answer>{s}</answer>") for c, s in zip(completions, solution)]

    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, max_completion_length=8,
                          per_device_train_batch_size=4, num_generations=4, learning_rate=1e-3, report_to="none",
                          use_cpu=True)  # (TRL 1.16 defaults to bf16, which it refuses on a CPU)
    trainer = GRPOTrainer(model="tiny-vision", args=args, reward_funcs=[think_format_reward, accuracy_reward],
                          train_dataset=dataset, eval_dataset=None, peft_config=None)
    trainer.train()
    trainer.save_model(args.output_dir)
    from grpo.training.observe.tracking import read_metrics

    logged = read_metrics(tmp_path / "out")
    assert trainer.step == 2 and any("reward/accuracy_reward" in r and "reward/think_format_reward" in r
                                     for r in logged)
    assert (tmp_path / "out" / "preprocessor_config.json").exists()


def test_lora_on_the_language_model_leaves_the_vision_tower_frozen(tmp_path):
    """lora_target_modules q_proj, v_proj name only the language model's attention (the vision tower's are qkv and
    proj): only those adapters train, and they do."""
    from grpo.training.trainer import GRPOTrainer

    trainer = GRPOTrainer(args=vision_config(tmp_path, use_peft=True, lora_target_modules=["q_proj", "v_proj"],
                                             lora_r=4, lora_alpha=8), reward_funcs=larger_answer,
                          train_dataset=get_task("shapes").dataset("train", n=16))
    trained = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert trained and all(".language_model." in n and "lora_" in n for n in trained)
    trainer.train()
    now = dict(trainer.policy.named_parameters())
    assert any(not torch.equal(trained[n], now[n]) for n in trained)


def test_rows_without_images_give_the_vision_tower_zero_gradients_and_sharding_refuses_them(vlm):
    """A micro-batch whose rows have no image (a dataset mixing image and text rows): the rows carry a blank image's
    features, run through the vision side at zero weight, so every vision parameter gets a gradient of exactly 0
    (without it: None, and DDP raises at the next step; the two-process run is in test_vision_distributed.py), and
    the log-probs are those of the pass without it. Under sharded weights such a dataset is refused by name."""
    import types

    from grpo.training.data.prompts import PromptSet
    from grpo.training.setup.sharded import check_sharded_images

    model, tok, processing = vlm
    prompts = PromptSet(["a", "b"], [[5, 6, 7], [8, 9, 10]], {}, images=[[], []], image_processing=processing)
    images = prompts.pixels([0, 1, 1])
    assert all(r.stand_in is not None and not r.features for r in images)
    ids = torch.tensor([[5, 6, 7, 11, 12], [8, 9, 10, 13, 14], [8, 9, 10, 15, 16]])
    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, ids, torch.ones_like(ids), 2, 1.0, images=images)
    logp.sum().backward()
    vision = {n: p.grad for n, p in model.named_parameters() if n.startswith("model.visual")}
    assert vision and all(g is not None and not g.any() for g in vision.values())
    with torch.no_grad():  # (no gradient, no stand-in pass: the logits path's plain log-probs)
        assert torch.equal(logp, completion_logprobs(model, ids, torch.ones_like(ids), 2, 1.0, images=images))
    model.zero_grad(set_to_none=True)
    fsdp = types.SimpleNamespace(distributed_type="FSDP")
    with pytest.raises(ConfigError, match=r"dataset row 0 has no image: with sharded weights \(FSDP2, ZeRO-3\)"):
        check_sharded_images(fsdp, prompts)
    check_sharded_images(types.SimpleNamespace(distributed_type="MULTI_GPU"), prompts)  # (DDP: the stand-in)
