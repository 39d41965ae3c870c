"""From prompts to a training batch, in step with the update or ahead of it: the rollout itself (`rollouts`), the source that feeds the loop (`sources`), the lag pipeline and its server path."""
