"""The LM head's kernels: per-token log-probs and entropies without the (N, T, V) logits in float32 (`logprobs`),
the loss's gradient in the log-prob pass (`loss`), and the cache-sized tiles both walk (`tiles`)."""

from grpo.engines.head.logprobs import hidden_logprobs, token_entropy, token_logprobs
from grpo.engines.head.loss import hidden_loss

__all__ = ["hidden_logprobs", "hidden_loss", "token_entropy", "token_logprobs"]
