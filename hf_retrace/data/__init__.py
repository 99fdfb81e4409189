"""Training and evaluation data: prompt sets (`prompts`), the offline default target (`assets`), the target's own
responses (`responses`: regeneration, tokenization, collators), and the pool of target generations with its
feature cache (`continuous_generation`, `pool`)."""
