"""Streamed datasets (grpo.training.data.stream): rows read as the run needs them, exact resume of the stream position,
bad rows named by index or skipped and counted."""

from __future__ import annotations

import json
import math

import datasets
import pytest
from safetensors.torch import load_file

from grpo import GRPOConfig, GRPOTrainer
from grpo.config import ConfigError
from grpo.training.data.stream import StreamingPrompts, epochs_done
from rewards_for_tests import count_a


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(tiny_model_dir, out, **kw):
    base = dict(model_name_or_path=tiny_model_dir, task=None, num_generations=4, prompts_per_step=2,
                per_device_train_batch_size=4, max_completion_length=6, learning_rate=1e-2, beta=0.04, max_steps=6,
                save_steps=1, save_total_limit=None, report_to=[], log_completions_steps=0, seed=0,
                output_dir=str(out))
    return GRPOConfig(**{**base, **kw})


class Tok:
    """A stand-in tokenizer: one id per character (enough for the sampler's bookkeeping)."""
    chat_template = None

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def test_stream_order_is_the_files_and_resumes_mid_epoch(tmp_path):
    """shuffle off: rows in file order, epoch after epoch; a sampler restored from a state continues identically."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    cfg = GRPOConfig(task=None, dataset_name=path, dataset_streaming=True, max_steps=1, shuffle_dataset=False)
    from grpo.training.setup.data import make_datasets

    stream, _ = make_datasets(cfg, None, None, None)
    a = StreamingPrompts(stream, Tok(), cfg, "")
    got = [a.rows(a.next(2))[0] for _ in range(2)]
    assert epochs_done(a, 2, 1) == 0.0  # the first pass: its length is not known yet
    got += [a.rows(a.next(2))[0]]
    assert got == [["p0", "p1"], ["p2", "p3"], ["p4", "p0"]]  # the third call crosses into epoch 1
    state = a.state_dict()
    assert state == {"epoch": 1, "position": 1, "served": 6, "skipped": 0, "rows_per_pass": 5}
    assert epochs_done(a, 3, 1) == 1.2  # train/epoch: one pass of 5 rows and 1 row of the next (not 3 steps / 1)
    b = StreamingPrompts(stream, Tok(), cfg, "")
    b.load_state_dict(state)
    assert [a.rows(a.next(3))[0] for _ in range(2)] == [b.rows(b.next(3))[0] for _ in range(2)]


def test_shuffle_buffer_is_seeded_and_reshuffles_each_epoch(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(20)])
    from grpo.training.setup.data import make_datasets

    def epochs(seed):
        cfg = GRPOConfig(task=None, dataset_name=path, dataset_streaming=True, max_steps=1, shuffle_buffer_size=8,
                         data_seed=seed)
        s = StreamingPrompts(make_datasets(cfg, None, None, None)[0], Tok(), cfg, "")
        rows = s.rows(s.next(40))[0]
        return rows[:20], rows[20:]

    first, second = epochs(1)
    assert sorted(first) == sorted(second) == sorted(f"p{i}" for i in range(20))  # each epoch: every row once
    assert first != [f"p{i}" for i in range(20)] and first != second  # shuffled, and differently per epoch
    assert epochs(1) == (first, second) and epochs(2) != (first, second)  # the seed decides


@pytest.mark.parametrize("row, reason", [({"prompt": None, "answer": "1"}, "the prompt is missing"),
                                         ({"prompt": 7, "answer": "1"}, "not text"),
                                         ({"prompt": "q", "answer": float("nan")}, "'answer' (read by the rewards)")])
def test_a_bad_row_is_named_by_its_index(tmp_path, tiny_model_dir, row, reason):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)]
    rows[3] = row
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # (json writes NaN, which datasets reads)
    # shuffled, 3 steps of 2 prompts read every row: row 3 is named by its index in the file
    cfg = config(tiny_model_dir, tmp_path / "run", dataset_name=str(path), dataset_streaming=True,
                 shuffle_buffer_size=4, max_steps=3, save_steps=0)
    with pytest.raises(ConfigError, match=r"dataset row 3: .*" + reason.replace("(", r"\(").replace(")", r"\)")):
        GRPOTrainer(reward_funcs=["math_accuracy"], args=cfg).train()
    # the same file, not streamed: the same row named
    cfg = config(tiny_model_dir, tmp_path / "run2", dataset_name=str(path), max_steps=2)
    with pytest.raises(ConfigError, match=r"dataset row 3: "):
        GRPOTrainer(reward_funcs=["math_accuracy"], args=cfg)


def test_bad_rows_skipped_and_counted(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(8)]
    rows[1], rows[5] = {"prompt": "", "answer": "1"}, {"prompt": "q", "answer": None}
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = config(tiny_model_dir, tmp_path / "run", dataset_name=path, dataset_streaming=True, shuffle_dataset=False,
                 dataset_on_bad_row="skip", max_steps=3, save_steps=0)
    trainer = GRPOTrainer(reward_funcs=["math_accuracy"], args=cfg)
    metrics = trainer.train()
    assert metrics["data/skipped_rows"] == 2.0  # 6 good prompts served over 3 steps of 2: rows 1 and 5 skipped once
    assert trainer.sampler.state_dict() == {"epoch": 0, "position": 8, "served": 6, "skipped": 2, "rows_per_pass": 0}
    # a map-style dataset skips them up front
    cfg = config(tiny_model_dir, tmp_path / "run2", dataset_name=path, dataset_on_bad_row="skip", max_steps=1,
                 save_steps=0)
    with pytest.warns(UserWarning, match="skipped 2 bad rows of 8"):
        trainer = GRPOTrainer(reward_funcs=["math_accuracy"], args=cfg)
    assert len(trainer.train_set) == 6 and trainer.train().get("data/skipped_rows") == 2.0


def test_streaming_needs_max_steps(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="max_steps: dataset_streaming"):
        GRPOConfig(dataset_name="x.jsonl", dataset_streaming=True)
    stream = datasets.IterableDataset.from_generator(lambda: ({"prompt": f"q{i}"} for i in range(4)))
    with pytest.raises(ConfigError, match="max_steps: a streamed dataset has no length"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], train_dataset=stream,
                    args=config(tiny_model_dir, tmp_path / "run", max_steps=-1))


@pytest.mark.parametrize("source", ["jsonl", "save_to_disk", "iterable"])
def test_resume_mid_stream_equals_the_uninterrupted_run(tmp_path, tiny_model_dir, source):
    """A run resumed from its checkpoint of step 3 (inside epoch 1 of a 10-row stream read 4 rows a step... and
    through a shuffle buffer) ends with the uninterrupted run's weights, bit for bit."""
    rows = [{"prompt": f"q{i}\n"} for i in range(7)]
    if source == "jsonl":
        data = dict(dataset_name=write_jsonl(tmp_path / "d.jsonl", rows), dataset_streaming=True,
                    shuffle_buffer_size=3)
        make = lambda: None  # noqa: E731
    elif source == "save_to_disk":
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
        data = dict(dataset_name=str(tmp_path / "disk"), dataset_streaming=True, shuffle_buffer_size=3)
        make = lambda: None  # noqa: E731
    else:  # a user's IterableDataset, shuffled upstream as TRL users do
        data = {}
        make = lambda: datasets.Dataset.from_list(rows).to_iterable_dataset().shuffle(seed=3,  # noqa: E731
                                                                                     buffer_size=3)
    # 6 steps x 2 prompts = 12 rows of a 7-row stream: the checkpoint of step 3 is inside epoch 0 (6 rows read),
    # the run goes on into epoch 1.
    straight = GRPOTrainer(reward_funcs=[count_a], train_dataset=make(),
                           args=config(tiny_model_dir, tmp_path / "a", **data))
    straight.train()
    assert straight.sampler.epoch == 1
    want = load_file(str(tmp_path / "a" / "final" / "model.safetensors"))
    resumed = GRPOTrainer(reward_funcs=[count_a], train_dataset=make(),
                          args=config(tiny_model_dir, tmp_path / "b", **data))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    got = load_file(str(tmp_path / "b" / "final" / "model.safetensors"))
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0
    assert resumed.sampler.state_dict() == straight.sampler.state_dict()
