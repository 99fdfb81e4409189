"""Training and evaluation data: prompt sets (`prompts`), the offline default target (`assets`), the target's own
responses (`responses`: regeneration, tokenization, collators), and the pool of target generations with its
feature cache (`continuous_generation`, `pool`), and the frozen target's features that the cache holds and training
reads (`target_features`).

The training code (`hf_retrace.trainer`) imports from here, never the other way round.
"""

IGNORE_INDEX = -100  # the label of a position no loss reads (torch's `cross_entropy` default `ignore_index`)
