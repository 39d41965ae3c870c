"""Long completions (issue 32, items 2 and 3): activation offload, the log-probs and entropies of rows longer than one
chunk, the sampler's attention mask at length, and DAPO's overlong handling at length.

The CPU cannot show offload's memory effect (every tensor is in host memory already); these tests check that the
hooks are applied where the update's forward runs, that copies made by them give the gradients of the plain pass, and
that parameters stay where they are. Memory is measured in bench/long_memory.py, never asserted here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo.config import ConfigError, GRPOConfig
from grpo.core import LossOutput
from grpo.engines.offload import ActivationOffload
from grpo.engines.packing import Packing, pack
from grpo.engines.policy import MicroBatch, TransformersBackend, completion_logprobs
from grpo.rewards import SoftOverlong

VOCAB = 300
ONE_ROW = Packing(False, None, None, "whole sequences in one row")


def tiny_model(layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config)


def long_rows(lengths: list[int], prompt: int = 16, seed: int = 1):
    """(input_ids, attention_mask (n, prompt + width), width): prompts of `prompt` tokens, completions of `lengths`
    right-padded."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), prompt + width), generator=g)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, :prompt + n] = 1
    return ids * mask, mask, width


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def loss_of(logp, entropy, mask):
    """Per-row means weighted by advantages, plus an entropy bonus: a loss whose gradient reaches every position."""
    adv = torch.linspace(-1.0, 1.0, logp.shape[0])
    return -(adv * (logp * mask).sum(1) / mask.sum(1)).mean() - 0.01 * (entropy * mask).sum() / mask.sum()


def grads_of(model, run) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- activation offload --------------------------------------------------------------------------------------------


def test_offload_setting_takes_verl_and_torchtune_names():
    assert GRPOConfig().activation_offloading is False
    assert GRPOConfig(enable_activation_offload=True).activation_offloading is True  # verl
    assert GRPOConfig(enable_activation_offloading=True).activation_offloading is True  # torchtune
    with pytest.raises(ConfigError, match="enable_activation_offload"):
        GRPOConfig(enable_activation_offload=True, activation_offloading=False)


class AsIfOnDevice(ActivationOffload):
    """The offload hooks with every tensor treated as one on an accelerator: eligible saved tensors are copied out and
    back (here host to host), the path a GPU takes."""

    @staticmethod
    def _on_host(tensor):
        return False


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_copies_give_the_plain_gradients(checkpointing):
    """Under the hooks every eligible saved tensor is replaced by a copy and restored from it in backward: the
    gradients are bitwise those of the plain pass, no parameter is copied, and with gradient checkpointing only the
    layers' inputs (and what the head and loss save) are saved at all."""
    model = tiny_model()
    ids, mask, width = long_rows([700, 500])
    packed = pack(ids, mask, width, ONE_ROW)
    real = mask[:, -width:].float()

    def run(hooks=None):
        with hooks if hooks is not None else contextlib.nullcontext():
            logp, entropy = completion_logprobs(model, ids, mask, width, 0.9, with_entropy=True, entropy_grad=True,
                                                packed=packed)
            loss = loss_of(logp, entropy, real)
        loss.backward()

    plain = grads_of(model, run)
    if checkpointing:  # (transformers >= 5.23's names, as grpo.training.setup.model)
        model.activation_checkpointing_enable({"use_reentrant": False})
    hooks = AsIfOnDevice(model)
    moved = grads_of(model, lambda: run(hooks))
    assert all(torch.equal(moved[n], plain[n]) for n in plain)
    assert hooks.stats.moved > 0 and hooks.stats.moved_bytes < hooks.stats.saved_bytes
    params = sum(p.numel() * 4 for p in model.parameters())
    full = AsIfOnDevice(model)
    model.activation_checkpointing_disable()
    grads_of(model, lambda: run(full))
    if checkpointing:  # per layer its input alone (10 KiB-ish tensors of 1.2k tokens x 64) instead of ~15 tensors
        assert hooks.stats.moved_bytes < full.stats.moved_bytes / 3
    else:
        assert hooks.stats.moved_bytes == full.stats.moved_bytes
    assert full.stats.moved_bytes > params  # (the activations of 1.2k tokens outweigh this tiny model)


def test_parameters_and_small_tensors_stay():
    lin = torch.nn.Linear(128, 256)
    hooks = AsIfOnDevice(lin, min_bytes=2**10)
    x = torch.randn(64, 128, requires_grad=True)
    with hooks:
        y = torch.nn.functional.linear(x, lin.weight, lin.bias).relu().sum()  # saves x, weight (a view), relu out
    y.backward()
    # x (64 x 128 x 4 = 32 KiB) and the relu output (64 KiB) move; the weight and its transposed view do not
    assert hooks.stats.moved_bytes == 64 * 128 * 4 + 64 * 256 * 4
    small = AsIfOnDevice(lin, min_bytes=2**20)
    with small:
        torch.nn.functional.linear(x, lin.weight, lin.bias).relu().sum().backward()
    assert small.stats.moved == 0 and small.stats.saved > 0


def _moved_shapes(model, run) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every saved tensor the hooks copy out during `run(hooks)`."""
    moved = []

    class Recorder(AsIfOnDevice):
        def pack(self, tensor):
            if self.eligible(tensor):
                moved.append((tuple(tensor.shape), tensor.dtype))
            return super().pack(tensor)

    run(Recorder(model, min_bytes=1024))
    return moved


@pytest.mark.parametrize("frozen_mlp", [False, True])
def test_autocast_casts_of_the_weights_stay(frozen_mlp):
    """fp32 weights under bf16 autocast without checkpointing: autocast's bf16 copy of every linear weight (and its
    transposed view, which F.linear saves) is not copied out, whether the weight trains (the cast's autograd node
    leads to the parameter) or is frozen (as LoRA's base weights: recognised by its shape). Before: 28 bf16
    weight-shaped copies, 1.7x the model's bf16 linear weights (gpu_review2 N8). 2 x 100 tokens: no activation
    shares a weight's shape (hidden 64, intermediate 128, 4 heads of 16, 2 of them for k and v)."""
    model = tiny_model()
    for name, p in model.named_parameters():
        p.requires_grad_(not (frozen_mlp and ".mlp." in name))
    weight_shapes = {s for p in model.parameters() if p.dim() == 2 for s in (tuple(p.shape), tuple(p.shape[::-1]))}
    ids = torch.randint(1, VOCAB, (2, 100), generator=torch.Generator().manual_seed(0))

    def run(hooks):
        with torch.autocast("cpu", dtype=torch.bfloat16), hooks:
            loss = model.get_decoder()(input_ids=ids).last_hidden_state.float().pow(2).mean()
        loss.backward()

    moved = _moved_shapes(model, run)
    assert len(moved) > 10  # the activations still move
    assert [m for m in moved if m[0] in weight_shapes] == []


def test_offload_under_fsdp2_reads_the_local_shards(tmp_path):
    """An FSDP2 model's parameters are DTensors, whose storage pointer cannot be read (gpu_review2 N1: "Attempted to
    access the data pointer on an invalid python storage" at the first update micro-batch). gloo, one process."""
    import subprocess
    import sys

    script = tmp_path / "fsdp2_offload.py"
    script.write_text(
        "import os, socket, torch, torch.distributed as dist\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK='0', WORLD_SIZE='1')\n"
        "dist.init_process_group('gloo')\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "from grpo.engines.offload import ActivationOffload\n"
        "m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))\n"
        "fully_shard(m, mesh=init_device_mesh('cpu', (1,)))\n"
        "hooks = ActivationOffload(m, min_bytes=1024)\n"
        "x = torch.randn(32, 64, requires_grad=True)\n"
        "with hooks:\n"
        "    y = m(x).sum()\n"
        "y.backward()\n"
        "assert hooks.stats.on_host_bytes >= 32 * 64 * 4, hooks.stats\n"
        "assert all(p.grad is not None for p in m.parameters())\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_copies_out_run_on_a_side_stream_and_back_after_them(monkeypatch):
    """On CUDA each copy to host memory is issued on a second stream (TRL's use_streams: it overlaps the forward's
    next kernels; before, on the compute stream, gpu_review2 N8): the side stream first waits for the compute stream
    (the tensor is written), the copy's event is recorded there, the tensor's block is marked as read by the side
    stream (not reused before the copy ends), and backward's copy back waits for that event. The CPU has no streams:
    torch.cuda's stream calls are stand-ins that record what is asked of them, and the gradients are the plain ones."""
    import grpo.engines.offload as offload

    log = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def record_event(self):
            log.append(("record_event", self.name))
            return f"event {len(log)}"

        def wait_event(self, event):
            log.append(("wait_event", self.name, event))

    @contextlib.contextmanager
    def on(stream):
        log.append(("enter", stream.name))
        yield
        log.append(("exit", stream.name))

    empty = torch.empty
    monkeypatch.setattr(offload, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream("compute"))
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))  # (no pinned memory here)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: log.append(("record_stream", stream.name)),
                        raising=False)

    class OnCuda(AsIfOnDevice):
        @staticmethod
        def _on_cuda(tensor):
            return True

    lin = torch.nn.Linear(128, 256)
    x = torch.randn(64, 128, requires_grad=True)
    plain = grads_of(lin, lambda: torch.nn.functional.linear(x, lin.weight, lin.bias).relu().sum().backward())
    hooks = OnCuda(lin, min_bytes=2**10)

    def run():
        with hooks:
            y = torch.nn.functional.linear(x, lin.weight, lin.bias).relu().sum()  # x and the relu output move
        log.append("backward")
        y.backward()

    moved = grads_of(lin, run)
    assert all(torch.equal(moved[n], plain[n]) for n in plain)
    out = [("wait_stream", "side", "compute"), ("enter", "side"), ("record_event", "side"), ("exit", "side"),
           ("record_stream", "side")]
    assert log[:11] == out + out + ["backward"]
    assert sorted(log[11:]) == [("wait_event", "compute", "event 3"), ("wait_event", "compute", "event 8")]


class _Accelerator:
    """The part of accelerate's Accelerator the backend uses, for one process without mixed precision."""

    num_processes = 1

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()


def test_update_pass_runs_under_the_offload_hooks():
    """`activation_offloading` reaches the update's forward: the hooks see its activations (on the CPU they are in
    host memory already, so nothing moves) and the gradients are those of the backend without it."""
    model = tiny_model()
    ids, mask, width = long_rows([600, 300])
    real = mask[:, -width:].float()
    micro = MicroBatch(ids, mask, width, packed=pack(ids, mask, width, ONE_ROW))

    def loss_fn(logp, rows, entropy):
        return LossOutput(loss_of(logp, entropy, real[rows]))

    backends = {on: TransformersBackend(model, _Accelerator(), offload=on) for on in (False, True)}
    grads = {on: grads_of(model, lambda: b.loss_and_backward(micro, 1.0, loss_fn, True, True))
             for on, b in backends.items()}
    stats = backends[True].offloaded
    assert backends[False].offloaded is None
    assert stats.on_host_bytes > 0 and stats.moved == 0
    assert all(torch.equal(grads[True][n], grads[False][n]) for n in grads[False])


# ---- log-probs and entropies of long rows in chunks ------------------------------------------------------------------


class LargestVocabularyTensor(TorchDispatchMode):
    """Records the largest tensor any operator produces whose last dimension is the vocabulary."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == VOCAB:
                self.largest = max(self.largest, t.numel())
        return out


def naive(model, ids, mask, width, temperature):
    """The unchunked computation: the model's full (N, L, V) logits, a float32 log-softmax over all of them."""
    from grpo.engines.kv_cache import positions

    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, -width - 1:-1]
    logs = torch.log_softmax(logits.float() / temperature, -1)
    return logs.gather(-1, ids[:, -width:, None])[..., 0], -(logs.exp() * logs).sum(-1)


@pytest.mark.parametrize("packed", [True, False])
def test_long_rows_are_scored_in_chunks_equal_to_the_full_softmax(packed):
    """Rows of 2,600 and 1,900 completion tokens (3 chunks of the head's 1,024 positions): the update's log-probs and
    entropies (with gradients) and the reference pass's (without) equal the unchunked full-logits computation to
    relative 1e-6, their gradients to 1e-5, and no tensor with more than one chunk's positions x V values exists."""
    model = tiny_model()
    ids, mask, width = long_rows([2600, 1900])
    real = mask[:, -width:].float()
    layout = pack(ids, mask, width, ONE_ROW) if packed else None
    with torch.no_grad():
        want_logp, want_entropy = naive(model, ids, mask, width, 0.7)
    want_grads = grads_of(model, lambda: loss_of(*naive(model, ids, mask, width, 0.7), real).backward())

    seen = LargestVocabularyTensor()
    with seen:
        logp, entropy = completion_logprobs(model, ids, mask, width, 0.7, with_entropy=True, entropy_grad=True,
                                            packed=layout)
    assert rel(logp * real, want_logp * real) < 1e-6 and rel(entropy * real, want_entropy * real) < 1e-6
    grads = grads_of(model, lambda: loss_of(logp, entropy, real).backward())
    assert max(rel(grads[n], want_grads[n]) for n in grads) < 1e-5
    with torch.no_grad(), seen:  # the reference and old-policy passes
        ref_logp, ref_entropy = completion_logprobs(model, ids, mask, width, 0.7, with_entropy=True, packed=layout)
    assert rel(ref_logp * real, want_logp * real) < 1e-6 and rel(ref_entropy * real, want_entropy * real) < 1e-6
    assert 0 < seen.largest <= 1024 * VOCAB < 2600 * VOCAB


# ---- long completions end to end -----------------------------------------------------------------------------------


def test_stock_sampler_at_length_scores_like_the_update_and_is_masked_when_truncated():
    """transformers' forward samples 1,500 tokens into rows of unequal prompts with every end token suppressed: the
    completions are cut at the budget (truncated), their sampling log-probs are the update pass's (so the attention
    mask of every step, a view of one preallocated mask, is right at every length), DAPO's soft overlong penalty is
    -1 for them and mask_truncated_completions leaves them out of the loss."""
    from grpo.engines.base import SamplingParams
    from grpo.engines.sampling import TransformersSampler
    from grpo.training.rollout.batch import pack as pack_rows

    model = tiny_model().eval()
    budget = 1500
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    out = TransformersSampler(model, 0, eos_ids=[]).generate(prompts, SamplingParams(budget), seeds=[1, 2])
    assert [len(c) for c in out.ids] == [budget, budget] and out.truncated == [True, True]
    ids, mask, loss_mask = pack_rows(prompts, out.ids, 0, [not t for t in out.truncated])
    with torch.no_grad():
        update = completion_logprobs(model, ids, mask, budget, 1.0)
    torch.testing.assert_close(update, torch.tensor(out.logprobs), atol=2e-4, rtol=1e-4)
    assert loss_mask.sum() == 0
    # the run's rule (grpo.training.setup.rewards): a buffer of ceil(0.2 x 1,500) = 300 tokens before the budget
    overlong = SoftOverlong(max_length=budget, cache_length=300)
    assert overlong(out.ids) == [-1.0, -1.0]


def test_soft_overlong_at_dapo_lengths():
    # DAPO's setting: L_max = 20,480, L_cache = 4,096, so the penalty starts after 16,384 tokens:
    # 16,384 -> 0; 17,408 -> (16,384 - 17,408) / 4,096 = -0.25; 18,432 -> -0.5; 20,479 -> -4,095/4,096; 20,480 -> -1.
    reward = SoftOverlong(max_length=20480, cache_length=4096)
    lengths = [16384, 17408, 18432, 20479, 20480]
    assert [reward.penalty(n) for n in lengths] == [0.0, -0.25, -0.5, -4095 / 4096, -1.0]
    assert reward(completion_ids=[[3] * n for n in lengths])[1:3] == [-0.25, -0.5]


def test_in_place_head_gradient_survives_saved_tensor_hooks():
    """The tiled head's in-place weight gradient lands in the parameter's .grad under any saved-tensor hooks (torch's
    save_on_cpu here): the saved weight it unpacks in backward is another tensor object, whose .grad autograd never
    reads (before the fix the head's part of the gradient was dropped)."""
    from grpo.engines.head import hidden_logprobs

    g = torch.Generator().manual_seed(3)
    head = torch.nn.Parameter(torch.randn(50, 8, generator=g))
    hidden, tokens = torch.randn(2, 30, 8, generator=g), torch.randint(0, 50, (2, 30), generator=g)
    hidden_logprobs(hidden, head, tokens, chunk_size=7, weight_grad_in_place=True)[0].sum().backward()
    plain, head.grad = head.grad, None
    with torch.autograd.graph.save_on_cpu():
        logp, _ = hidden_logprobs(hidden, head, tokens, chunk_size=7, weight_grad_in_place=True)
    logp.sum().backward()
    assert head.grad is not None and torch.equal(head.grad, plain)


def test_a_run_with_activation_offloading_trains_as_without(tiny_model_dir, tmp_path):
    """`grpo train activation_offloading=true` on the transformers engine: its update passes run under the hooks
    (which see the saved tensors and, on the CPU, move nothing) and 2 steps reach the weights of the run without."""
    from datasets import Dataset

    from grpo import GRPOTrainer
    from rewards_for_tests import count_a

    finals, backends = [], []
    for on in (False, True):
        cfg = GRPOConfig(output_dir=str(tmp_path / str(on)), task=None, num_generations=4, prompts_per_step=2,
                         max_completion_length=8, learning_rate=1e-2, beta=0.0, max_steps=2, save_steps=0,
                         report_to=[], log_completions_steps=0, seed=0, task_eval_size=0, engine="transformers",
                         enable_activation_offload=on)
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=[count_a], args=cfg,
                              train_dataset=Dataset.from_dict({"prompt": [f"q{i}\n" for i in range(8)]}))
        trainer.train()
        finals.append({k: v.clone() for k, v in trainer.policy.state_dict().items()})
        backends.append(trainer.backend)
    assert backends[0].offloaded is None and backends[1].offloaded.saved > 0  # (8-token rows: none over 64 KiB)
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
