"""End-to-end training with DP x CP: a small Qwen3-style model, data, attention backends, the loop."""
