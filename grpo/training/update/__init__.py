"""The update: the batch layout and each rollout's optimizer steps (`steps`), micro-batches, the loss's terms together (`objective`), and the mechanics that run them (`mechanics`)."""
