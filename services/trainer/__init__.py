"""The megatron-core RL trainer: sample groups from Redis in, new weight versions out."""
