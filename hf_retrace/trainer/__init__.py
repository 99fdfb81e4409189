"""Training a DFlash / ReTrace drafter against a frozen target: [`ReTraceTrainer`] and its [`ReTraceConfig`].

Modules: `config` (ReTraceConfig), `trainer` (ReTraceTrainer), `setup` (target, drafter and synthetic data for the
entry points), `objective` (the DFlash block objective and the two-round ReTrace simulation), `masks`, `losses`,
`draft_vocab` (the reduced draft vocabulary), `drafter_init` (warm start from the target),
`frozen_target` (the target sharded under FSDP / ZeRO-3, placed on the device otherwise).
`masks` and `losses` need torch only; the trainer needs the `train` extra (trl, datasets, peft),
so it is imported on first use.
"""

_LAZY = {"ReTraceTrainer": "trainer", "ReTraceConfig": "config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ReTraceConfig", "ReTraceTrainer"]
