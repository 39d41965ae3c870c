"""RewardModel: a tiny random Qwen2 sequence classifier with a character tokenizer, built offline in a temp dir."""

import string

import pytest
import torch

from grpo.rewards import RewardModel, RewardRunner, resolve_reward, think_format

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"


def save_char_tokenizer(path, chat_template=None, pad_token=None):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for char in string.ascii_letters + string.digits + " +-*/=<>\n_":
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token=pad_token,
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer Qwen2ForSequenceClassification (1 label) and its chat-templated character tokenizer."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    path = tmp_path_factory.mktemp("tiny-rm")
    tokenizer = save_char_tokenizer(path, CHAT_TEMPLATE, pad_token="<pad>")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=None,
    )
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_model(model_dir):
    return RewardModel(model_dir, batch_size=2)


def test_scores_are_logits_of_the_last_token(reward_model):
    prompts, completions = ["2+2=", "1+1=", "3*3="], ["4", "2 or 3", "9<eos>"]
    scores = reward_model(prompts=prompts, completions=completions)
    assert len(scores) == 3 and all(isinstance(s, float) for s in scores)
    assert len(set(scores)) == 3  # a random model still tells different texts apart
    for prompt, completion, score in zip(prompts, completions, scores):
        ids = reward_model.tokenizer(prompt + completion, add_special_tokens=False, return_tensors="pt").input_ids
        # Unpadded, alone: the model pools the last token, so logits[:, 0] is the reference score.
        with torch.no_grad():
            expected = reward_model.model(input_ids=ids).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-5)


def test_batching_does_not_change_scores(model_dir, reward_model):
    prompts, completions = ["a", "bb", "ccc", "d"], ["x" * 9, "y", "zz", "w" * 5]
    one_by_one = RewardModel(model_dir, batch_size=1)(prompts=prompts, completions=completions)
    assert reward_model(prompts=prompts, completions=completions) == pytest.approx(one_by_one, abs=1e-5)


def test_text_uses_the_chat_template_for_conversations(reward_model, tmp_path):
    prompt = [{"role": "user", "content": "2+2"}]
    assert reward_model.text(prompt, "4") == "<user>2+2\n<assistant>4\n"
    assert reward_model.text(prompt, [{"role": "assistant", "content": "4"}]) == "<user>2+2\n<assistant>4\n"
    assert reward_model.text("2+2=", [{"role": "assistant", "content": "4"}]) == "2+2=4"
    # A tokenizer without a chat template concatenates the text; without a pad token it pads with eos (as TRL).
    save_char_tokenizer(tmp_path / "plain")
    plain = RewardModel(reward_model.path, tokenizer=str(tmp_path / "plain"))
    assert plain.text([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "a") == "s\nqa"
    assert plain.tokenizer.pad_token == "<eos>" and plain.model.config.pad_token_id == 1
    assert len(plain(prompts=["a", "bbb"], completions=["x", "y"])) == 2


def test_mixed_with_rule_rewards_through_the_registry(model_dir, reward_model):
    name, func = resolve_reward({"name": model_dir, "batch_size": 3})
    assert isinstance(func, RewardModel) and name == reward_model.__name__ and func.batch_size == 3
    runner = RewardRunner([(name, func), resolve_reward("think_format")], weights=[1.0, 0.5])
    completions = ["a</think>\n<answer>4</answer>", "4"]
    out = runner(["2+2=", "2+2="], completions, [[1], [2]], {})
    model_scores = reward_model(prompts=["2+2="] * 2, completions=completions)
    formats = think_format(completions)
    assert formats == [1.0, 0.0]
    assert out.total == pytest.approx([s + 0.5 * f for s, f in zip(model_scores, formats)])


def test_bad_checkpoint_directory(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_reward(str(tmp_path))


def test_a_reward_model_goes_to_this_processs_accelerator_in_16_bits(monkeypatch):
    """By default a reward model by path runs where this process computes: its own GPU (index fixed at construction,
    so a reward thread, whose current device is 0, keeps it) in bf16, fp16 without bf16; before: the CPU in fp32 on
    a GPU run, and `device: cuda` meant cuda:0 in a thread (gpu_review2 N11). The CPU stays float32. (The GPU is
    faked: the placement is what is checked.)"""
    import types

    import accelerate.state

    from grpo.rewards.reward_model import placement

    monkeypatch.setattr(accelerate.state, "is_initialized", lambda: False)  # (no trainer in this process)
    assert placement(None, None) == (torch.device("cpu"), torch.float32)
    assert placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)  # (this process: local rank 3)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert placement(None, None) == (torch.device("cuda", 3), torch.bfloat16)
    assert placement("cuda", "auto") == (torch.device("cuda", 3), "auto")
    assert placement("cuda:1", "float32") == (torch.device("cuda", 1), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert placement(None, None) == (torch.device("cuda", 3), torch.float16)
    # a trainer's run on the CPU of a GPU host: its device, not the GPU (CUDA never initialised before a fork)
    monkeypatch.setattr(accelerate.state, "is_initialized", lambda: True)
    monkeypatch.setattr(accelerate.state, "AcceleratorState", lambda: types.SimpleNamespace(device=torch.device("cpu")))
    assert placement(None, None) == (torch.device("cpu"), torch.float32)
