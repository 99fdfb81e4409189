# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Trainer callbacks of [`ReTraceTrainer`]."""

from transformers import TrainerCallback

from ..models.modeling_retrace import ReTraceTrajectoryEncoder


def set_beta(model, beta: float) -> None:
    """Sets the correction coefficient `beta` of every ReTrace module in `model` (through any wrapper)."""
    for module in model.modules():
        if isinstance(module, ReTraceTrajectoryEncoder):
            module.beta = beta  # a plain float attribute (not a buffer)


def warmed_up_beta(global_step: int, max_steps: int, warmup_steps: int | None) -> float:
    """Linear warm-up of `beta` (paper App. D): 0 at step 0, 1 from `warmup_steps` on (unset: 10% of `max_steps`).

    Example: `warmup_steps=4` gives 0, 0.25, 0.5, 0.75, 1, 1, ... at steps 0, 1, 2, ...
    """
    warmup = int(0.1 * max_steps) if warmup_steps is None else warmup_steps
    return 1.0 if warmup == 0 else min(1.0, global_step / warmup)


class BetaWarmupCallback(TrainerCallback):
    """Warms `beta` up linearly with the optimizer step (`ReTraceConfig.beta_warmup_steps`) and leaves it at its
    inference value 1 when training ends.

    `beta` is set for step `k` at the end of step `k - 1` (and at the start of training, which covers resuming), so
    every micro-batch of step `k`, and an evaluation right after it, see `warmed_up_beta(k)`.
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        set_beta(model, warmed_up_beta(state.global_step, state.max_steps, args.beta_warmup_steps))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        set_beta(model, warmed_up_beta(state.global_step, state.max_steps, args.beta_warmup_steps))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        set_beta(model, 1.0)


__all__ = ["BetaWarmupCallback", "set_beta", "warmed_up_beta"]
