"""Vision-language families beyond Qwen2-VL, from transformers' generic path: tiny random-weight Qwen2.5-VL, Gemma 3,
LLaVA and Idefics3 models built from config objects (tests/vision_families.py), each saved with its processor (or,
for Qwen2.5-VL, its tokenizer and image processor: its processor needs torchvision). For each: the update pass's
log-probs equal a plain forward of the same rows, the sampler's equal a padded forward's and never hold an image
token, and a GRPO step on shapes rows runs through the trainer and moves the vision tower's weights."""

from __future__ import annotations

import pytest
import torch

from grpo.config import GRPOConfig
from grpo.engines.base import SamplingParams
from grpo.engines.images import model_inputs, vision_token_ids
from grpo.engines.policy import completion_logprobs
from grpo.engines.sampling import TransformersSampler
from grpo.tasks import get_task
from grpo.training.data.prompts import render_prompt
from grpo.training.rollout.batch import pack
from grpo.training.data.vision import ImageProcessing, ProcessorImages, vision_prompts
from vision_families import FAMILIES, build, microbatched_logprobs


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, model directory, model, tokenizer, processing) of one family."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    path = build(request.param, tmp_path_factory.mktemp(request.param))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    return request.param, path, model, tok, ImageProcessing.of(None, tok, str(path))


def prompt_rows(processing, n: int, seed: int = 0):
    """n shapes prompts: (their rendered texts, token ids, RowImages, PIL images)."""
    rows = get_task("shapes").make_rows("train", n, seed)
    texts = []

    def render(messages):
        texts.append(render_prompt(messages, processing.tokenizer, GRPOConfig(), ""))
        return texts[-1]

    ids, images = vision_prompts([r["prompt"] for r in rows], {"image": [r["image"] for r in rows]}, processing,
                                 render, None)
    return texts, ids, processing.row_features(images), images


def test_the_processor_is_the_familys_own_and_image_tokens_are_expanded(family):
    """Gemma 3, LLaVA and Idefics3 load their processors (AutoProcessor); Qwen2.5-VL's needs torchvision, so its
    tokenizer and image processor expand <|image_pad|>. Each prompt holds the image tokens the family puts per
    picture: Qwen2.5-VL 64x64 / 8-pixel patches / 2x2 merge = 16; Gemma 3 mm_tokens_per_image = 16; LLaVA 32x32 /
    8-pixel patches = 16; Idefics3 (32/8)^2 / 2^2 = 4."""
    name, _, model, _, processing = family
    assert isinstance(processing, ImageProcessing if name == "qwen2_5_vl" else ProcessorImages)
    _, ids, _, _ = prompt_rows(processing, 2)
    expected = {"qwen2_5_vl": 16, "gemma3": 16, "llava": 16, "idefics3": 4}[name]
    assert [row.count(model.config.image_token_id) for row in ids] == [expected, expected]


def test_micro_batched_update_logprobs_equal_a_plain_forward_of_each_row(family):
    """Rows of different prompt lengths (left padding differs), cut into micro-batches of 2 in a shuffled order:
    their log-probs equal those of a plain forward of each row alone, made from the processor's own output for that
    row (its ids, pixel keys and token types, the completion appended) where the family has a processor. With the
    pictures swapped between rows they differ (the check can fail)."""
    name, _, model, tok, processing = family
    texts, ids, images, pil = prompt_rows(processing, 4, seed=1)
    ids[1] = ids[1] + [ids[1][-1]] * 3
    texts[1] = None  # (its ids no longer come from its text: a plain forward of it uses model_inputs)
    gen = torch.Generator().manual_seed(0)
    completions = [torch.randint(3, 250, (k,), generator=gen).tolist() for k in (3, 5, 2, 4)]
    got, input_ids, attention, mask = microbatched_logprobs(model, tok.pad_token_id, ids, completions, images)
    with torch.no_grad():
        for r in range(4):
            k = len(completions[r])
            inputs = plain_inputs(processing, texts[r], pil[r], ids[r], completions[r], images[r], model.config)
            logits = model(**inputs).logits[0, :-1]
            plain = logits.log_softmax(-1)[-k:].gather(1, inputs["input_ids"][0, -k:, None])[:, 0]
            torch.testing.assert_close(got[r, :k], plain, atol=1e-5, rtol=1e-5)
        swapped = completion_logprobs(model, input_ids, attention, mask.shape[1], 1.0, images=images[::-1])
    assert ((swapped - got) * mask).abs().max() > 1e-4


def plain_inputs(processing, text, pil, ids, completion, row_images, config) -> dict:
    """One row's forward inputs, prompt + completion: the processor's own output for its text and picture (with the
    completion's ids appended, token types 0 there) when there is a processor and text, else model_inputs."""
    if isinstance(processing, ProcessorImages) and text is not None:
        out = processing.processor(text=[text], images=[pil], add_special_tokens=False, return_tensors="pt")
        assert out["input_ids"][0].tolist() == ids  # (the prompt set's ids are the processor's)
        tail = torch.tensor([completion])
        inputs = {k: v for k, v in out.items() if k != "attention_mask"}
        for key, value in out.items():
            if key != "attention_mask" and value.shape == out["input_ids"].shape:
                inputs[key] = torch.cat([value, tail if key == "input_ids" else torch.zeros_like(tail)], 1)
        return inputs
    row = torch.tensor([ids + completion])
    return {"input_ids": row, **model_inputs([row_images], row, config)}


def test_sampled_logprobs_equal_a_forward_and_no_image_token_is_sampled(family):
    """Generation carries each row's pixels (and positions: M-RoPE offsets for Qwen2.5-VL, the text positions of the
    left-padded rows for the others): the sampler's log-probs equal one padded forward's over prompt + completion,
    under the distribution it samples from (the vision tokens banned). With the head pushed +50 towards the image
    token, no completion holds one."""
    name, _, model, tok, processing = family
    _, ids, images, _ = prompt_rows(processing, 3)
    ids[1] = ids[1] + [ids[1][-1]] * 3
    sampler = TransformersSampler(model, tok.pad_token_id, [tok.eos_token_id])
    out = sampler.generate(ids, SamplingParams(max_new_tokens=5), [0, 1, 2], images=images)
    input_ids, attention, mask = pack(ids, out.ids, tok.pad_token_id, [True] * 3)
    T = mask.shape[1]
    config = model.config
    with torch.no_grad():
        inputs = model_inputs(images, input_ids, config)
        if name != "qwen2_5_vl":
            inputs["position_ids"] = (attention.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention, **inputs).logits[:, -T - 1:-1].clone()
    logits[..., vision_token_ids(config)] = float("-inf")
    forward = logits.log_softmax(-1).gather(2, input_ids[:, -T:, None])[..., 0]
    sampled = torch.zeros_like(forward)
    for r, lp in enumerate(out.logprobs):
        sampled[r, :len(lp)] = torch.tensor(lp)
    torch.testing.assert_close(forward * mask, sampled * mask, atol=2e-4, rtol=1e-4)

    handle = model.lm_head.register_forward_hook(lambda m, a, output: output.index_add_(
        -1, torch.tensor([config.image_token_id]), torch.full((*output.shape[:-1], 1), 50.0)))
    try:
        pushed = sampler.generate(ids, SamplingParams(max_new_tokens=4), [0, 1, 2], images=images)
    finally:
        handle.remove()
    banned = set(vision_token_ids(config))
    assert config.image_token_id in banned and all(t not in banned for row in pushed.ids for t in row)


def test_a_grpo_step_runs_and_trains_the_vision_tower(family, tmp_path):
    """Two GRPO steps through the trainer on shapes rows (the family's model loaded from its directory, its
    processor from there too): the weights of both the language model and the vision tower move (the pixels reach
    the loss's gradient), and the saved directory loads again, its processor (or tokenizer and image processor) too."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from grpo.training.trainer import GRPOTrainer

    name, path, _, _, _ = family
    args = GRPOConfig(model_name_or_path=str(path), output_dir=str(tmp_path / "run"), max_steps=2, num_generations=4,
                      per_device_train_batch_size=4, max_completion_length=4, learning_rate=1e-2, beta=0.04,
                      report_to=[], save_strategy="no", disable_tqdm=True, eval_strategy="no", engine="transformers")
    trainer = GRPOTrainer(args=args, reward_funcs=first_byte, train_dataset=get_task("shapes").dataset("train", n=8))
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    trainer.train()
    changed = [k for k, v in trainer.policy.state_dict().items() if not torch.equal(before[k], v)]
    tower = {"qwen2_5_vl": "model.visual.", "gemma3": "model.vision_tower.", "llava": "model.vision_tower.",
             "idefics3": "model.vision_model."}[name]
    assert any(k.startswith(tower) for k in changed), changed[:5]
    assert any(k.startswith(("model.language_model.", "model.text_model.")) for k in changed), changed[:5]
    final = tmp_path / "run" / "final"
    AutoModelForImageTextToText.from_pretrained(final)
    assert type(ImageProcessing.of(None, AutoTokenizer.from_pretrained(final), str(final))) is type(trainer.images)


def first_byte(completions, **kwargs):
    """The first character's code / 255: random models' completions differ in it, so every group has a spread."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [ord(t[0]) / 255 if t else 0.0 for t in texts]


def test_a_family_whose_processor_needs_torchvision_is_refused_by_name(tmp_path):
    """SmolVLM's processor builds a video processor, which needs torchvision (absent here): the run stops before the
    weights load, naming the model directory and what its processor lacks. (With torchvision installed the same
    directory takes the processor path: skipped there.)"""
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision is installed: SmolVLM's processor loads")
    except ImportError:
        pass
    from transformers import AutoTokenizer

    from grpo.config import ConfigError
    from vision_families import smolvlm

    path = smolvlm(tmp_path / "smolvlm")
    with pytest.raises(ConfigError, match=r"is a vision-language model whose processor does not load "
                                          r"\(SmolVLMVideoProcessor requires the Torchvision library"):
        ImageProcessing.of(None, AutoTokenizer.from_pretrained(path), str(path))


def test_a_processor_that_names_mm_token_type_ids_gets_them_made_per_row():
    """transformers 5.17's Qwen2-VL computes M-RoPE from mm_token_type_ids and raises without them, but its processor
    returns them only when given text; the rows' images-only features declare them per token when the processor
    names them as a model input, so model_inputs makes them from the ids (1 on image tokens). Found by
    bench/gpu_check.py's C5 in the GPU image (scripts/simulate_gpu_image.sh)."""
    import types

    class Processor:  # an images-only call gives pixels and grids, no ids (Qwen2VLProcessor without text)
        model_input_names = ["pixel_values", "image_grid_thw", "input_ids", "attention_mask", "mm_token_type_ids"]
        tokenizer = image_processor = None

        def __call__(self, images, return_tensors):
            return {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}

    rows = ProcessorImages(Processor()).row_features([["a picture"]])
    assert rows[0].token_types == ("mm_token_type_ids",)
    inputs = model_inputs(rows, torch.tensor([[1, 7, 7, 2]]), types.SimpleNamespace(image_token_id=7))
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 0]]
