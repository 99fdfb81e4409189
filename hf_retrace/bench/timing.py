"""Timing instruments of `hf-retrace bench` (measurement: `hf_retrace.bench.run` module docstring).

[`TargetCycleRecorder`] counts the tokens each target forward commits (one forward = one cycle, for `ar` and prompt
lookup); [`ConditioningTimer`] measures the wall time ReTrace spends on conditioning. Neither changes a computation.
"""

import importlib
import time

import torch

from ..models.modeling_retrace import ReTraceDrafterModel


class TargetCycleRecorder:
    """Forward pre-hook on the target: tokens committed by each target forward (one forward = one cycle).

    Committed length before forward k: the prompt length for k = 0; afterwards the last committed token is the first
    input, at position `position_ids[0, 0]`, so the length is that position + 1. Cycle k committed the difference
    to the next forward's length (the final sequence length for the last one). Worked example, prompt of 7, ar:
    forwards start at lengths 7, 8 (position 7), 9 ... so each commits 1.
    """

    def __init__(self, target, prompt_length: int):
        self.prompt_length, self.lengths = prompt_length, []
        self._handle = target.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if not self.lengths:
            self.lengths.append(self.prompt_length)
            return
        position_ids = kwargs.get("position_ids")
        start = int(position_ids[0, 0]) if position_ids is not None else kwargs["cache"].get_seq_length()
        self.lengths.append(start + 1)

    def remove(self) -> None:
        self._handle.remove()

    def committed(self, final_length: int) -> list[int]:
        ends = self.lengths[1:] + [final_length]
        return [end - start for start, end in zip(self.lengths, ends)]


class ConditioningTimer:
    """Wall time ReTrace spends on conditioning while it is entered: building the rejected trajectory, projecting its target features and the drafter's `retrace` submodule (perf_counter, with a
    CUDA sync around each span on GPU, which costs drafter methods a few syncs per cycle there). Wraps the generator's
    helpers for the duration only and restores them on exit; it changes no computation."""

    def __init__(self, drafter: ReTraceDrafterModel):
        self.drafter, self.seconds = drafter, 0.0
        self._generation = importlib.import_module(type(drafter).__module__.rsplit(".", 1)[0] + ".generation_retrace")
        self._trajectory_features = None
        self._restore, self._handles = [], []

    def _sync(self):
        if self.drafter.device.type == "cuda":
            torch.cuda.synchronize(self.drafter.device)

    def _timed(self, fn, keep_trajectory: bool = False):
        def wrapper(*args, **kwargs):
            self._sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.seconds += time.perf_counter() - start
            if keep_trajectory:
                self._trajectory_features = None if out is None else out.target_features
            return out

        return wrapper

    def _projection(self, project):
        timed = self._timed(project)

        def wrapper(features):  # only the projection of the trajectory's features is conditioning work
            return timed(features) if features is self._trajectory_features else project(features)

        return wrapper

    def _start(self, module, args):
        self._sync()
        self._span_start = time.perf_counter()

    def _stop(self, module, args, output):
        self._sync()
        self.seconds += time.perf_counter() - self._span_start

    def __enter__(self):
        gen = self._generation
        self._restore = [(gen, "build_rejected_trajectory", gen.build_rejected_trajectory)]
        gen.build_rejected_trajectory = self._timed(gen.build_rejected_trajectory, keep_trajectory=True)
        self.drafter.project_context = self._projection(self.drafter.project_context)
        retrace = self.drafter.retrace
        self._handles = [retrace.register_forward_pre_hook(self._start), retrace.register_forward_hook(self._stop)]
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._restore:
            setattr(owner, name, original)
        del self.drafter.project_context
        for handle in self._handles:
            handle.remove()
        self._trajectory_features = None
