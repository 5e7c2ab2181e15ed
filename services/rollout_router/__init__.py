"""Rollout router: balances SGLang-compatible engines and runs rollouts into Redis."""
