"""One process of the mixed-images DDP check (test_vision_distributed.py), launched by torch.distributed.run with gloo:

    python -m torch.distributed.run --nproc_per_node 2 vision_ddp_driver.py OUT_DIR

The tiny vision model (grpo/assets/tiny-vision), its vision tower trainable, under DDP as accelerate builds it
(find_unused_parameters off). Rank 0's rows carry a shapes picture each, rank 1's carry none (a dataset that mixes
image and text-only rows): three update steps of the update's pass (completion_logprobs, backward, AdamW). Without
gradients for the vision parameters on rank 1, DDP raises at the second step ("Expected to have finished reduction
in the prior iteration"). Writes OUT_DIR/rank<R>.json: the steps done and whether the vision weights stayed equal
across the two processes (they must: DDP averaged their gradients).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ASSET = Path(__file__).parent.parent / "grpo" / "assets" / "tiny-vision"


def rows(processing, with_images: bool):
    """(input_ids, attention_mask, width, images) of two rows with 3-token completions."""
    from grpo.config import GRPOConfig
    from grpo.tasks import get_task
    from grpo.training.data.prompts import PromptSet, render_prompt
    from grpo.training.data.vision import vision_prompts

    shapes = get_task("shapes").make_rows("train", 2, 0)
    render = lambda m: render_prompt(m, processing.tokenizer, GRPOConfig(), "")  # noqa: E731
    table = {"image": [r["image"] for r in shapes]} if with_images else {}
    ids, images = vision_prompts([r["prompt"] for r in shapes], table, processing, render, None)
    features = PromptSet([r["prompt"] for r in shapes], ids, {}, images=images,
                         image_processing=processing).pixels([0, 1])
    width, prompt = 3, max(len(x) for x in ids)
    input_ids = torch.zeros(2, prompt + width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r, x in enumerate(ids):
        input_ids[r, prompt - len(x):] = torch.tensor(x + [5, 6, 7])
        mask[r, prompt - len(x):] = 1
    return input_ids, mask, width, features


def main(out: Path) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from grpo.engines.policy import completion_logprobs
    from grpo.training.data.vision import ImageProcessing

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(ASSET).train()
    processing = ImageProcessing(AutoTokenizer.from_pretrained(ASSET), AutoImageProcessor.from_pretrained(ASSET))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    input_ids, mask, width, images = rows(processing, with_images=rank == 0)
    steps, error = 0, None
    try:
        for _ in range(3):
            logp = completion_logprobs(ddp, input_ids, mask, width, 1.0, images=images)
            logp.mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
    except RuntimeError as err:
        error = str(err).splitlines()[0]
    vision = torch.cat([p.detach().reshape(-1) for n, p in model.named_parameters() if n.startswith("model.visual")])
    gathered = [torch.zeros_like(vision) for _ in range(2)] if error is None else None
    if gathered is not None:
        dist.all_gather(gathered, vision)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "steps": steps, "error": error,
        "vision_equal": None if gathered is None else bool(torch.equal(gathered[0], gathered[1]))}))
    if error is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
