# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Drafter-training throughput in supervised draft slots per second, across recipes and across commits, in one run.

A supervised draft slot is a block slot with a label (`block_labels(...) != -100`); slots per second (summed over
the batch, per optimizer-step wall time including data loading) compare fairly across block sizes, anchor counts and
batch sizes. Each run is `--warmup + --steps` real [`ReTraceTrainer`] steps of a recipe on rows of the SmolLM2 pool,
in its own process. A run spec is `LABEL:REF:RECIPE[:OVERRIDES]`: `REF` is `.` for this working tree or any git
revision, checked out in a temporary `git worktree` and imported from there (so the old commit's own trainer is
timed); OVERRIDES are `key=value` pairs joined by `,`. Runs are interleaved over `--rounds` (the machine is noisy).

Usage (the comparison in results/drafter/README.md: the old SmolLM2 recipe at the last commit before the feature cache,
against the cached-feature recipe):

```bash
python benchmarks/train_throughput.py \
    --run old:915834a:training/recipes/smollm2-135m-dflash.yaml \
    --run new:.:training/recipes/smollm2-135m-dflash-cached.yaml
```

`dflash` training mode only (ReTrace steps call `block_labels` for both simulated rounds).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _worker(args) -> dict:
    """One run inside the tree `args.root` (its own `hf_retrace` and `training/train.py`)."""
    sys.path[:0] = [args.root, os.path.join(args.root, "training")]
    import hf_retrace.trainer.objective as forward
    from train import main, make_parser
    from transformers import TrainerCallback

    from hf_retrace.trainer.trainer import ReTraceTrainer

    slots, ends = [], []
    original_labels = forward.block_labels

    def counting_labels(*a, **k):
        labels = original_labels(*a, **k)
        slots.append(int((labels != -100).sum()))
        return labels

    forward.block_labels = counting_labels

    class StepEnd(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())

    original_init = ReTraceTrainer.__init__

    def init(self, *a, **k):
        original_init(self, *a, **k)
        self.add_callback(StepEnd())

    ReTraceTrainer.__init__ = init
    overrides = [f"--{item}" for item in args.overrides.split(",") if item] if args.overrides else []
    script_args, training_args, model_args = make_parser().parse_args_and_config(
        ["--config", args.recipe, "--output_dir", tempfile.mkdtemp(), "--max_steps", str(args.warmup + args.steps),
         "--save_strategy", "no", "--logging_steps", "100000", "--report_to", "none", "--disable_tqdm", "true",
         "--dataset_name", args.dataset, *overrides]
    )  # fmt: skip
    start = time.perf_counter()
    main(script_args, training_args, model_args)
    timed = [b - a for a, b in zip(ends[args.warmup - 1 : -1], ends[args.warmup :])] if args.warmup else []
    timed_slots = slots[args.warmup : args.warmup + len(timed)]
    return {
        "s_per_step": sum(timed) / len(timed), "slots_per_step": sum(timed_slots) / len(timed_slots),
        "slots_per_s": sum(timed_slots) / sum(timed), "wall_s": time.perf_counter() - start,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }  # fmt: skip


def _tokenized_pool(pool_dir: Path, rows: int, out: Path) -> Path:
    """The first `rows` pool rows as a tokenized `datasets` folder (`input_ids`, `loss_mask`) for online recipes."""
    from datasets import Dataset

    from hf_retrace.data.pool import read_token_shards

    records = read_token_shards(pool_dir)[:rows]
    Dataset.from_dict({
        "input_ids": [r["prompt_ids"] + r["response_ids"] for r in records],
        "loss_mask": [[0] * len(r["prompt_ids"]) + [1] * len(r["response_ids"]) for r in records],
    }).save_to_disk(str(out))  # fmt: skip
    return out


def _tree(ref: str, scratch: Path) -> Path:
    if ref == ".":
        return ROOT
    path = scratch / f"worktree-{ref}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref], check=True,
                       capture_output=True)  # fmt: skip
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", default=[], help="LABEL:REF:RECIPE[:OVERRIDES], repeatable")
    parser.add_argument("--pool", default=str(ROOT / "data" / "smollm2-pool"), help="token shards")
    parser.add_argument("--features", default=str(ROOT / "data_cache" / "smollm2-features"), help="feature cache")
    parser.add_argument("--rows", type=int, default=256, help="pool rows given to online recipes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of every run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("root", "recipe", "dataset", "overrides"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    if not args.run:
        parser.error("give at least one --run LABEL:REF:RECIPE[:OVERRIDES]")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step's end is the timing origin)")
    scratch = Path(tempfile.mkdtemp(prefix="hf_retrace-throughput-"))
    tokenized = _tokenized_pool(Path(args.pool), args.rows, scratch / "tokenized")
    specs = []
    for spec in args.run:
        parts = spec.split(":", 3)
        if len(parts) < 3:
            parser.error(f"--run must be LABEL:REF:RECIPE[:OVERRIDES], got {spec!r}")
        label, ref, recipe = parts[:3]
        specs.append((label, _tree(ref, scratch), recipe, parts[3] if len(parts) == 4 else ""))
    try:
        results = _run_interleaved(specs, args, tokenized)
    finally:  # the worktrees of other commits are scratch: remove them from the repository's list
        for _, tree, _, _ in specs:
            if tree != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    _print_table(results)


def _run_interleaved(specs, args, tokenized: Path) -> dict[str, list[dict]]:
    results = {label: [] for label, *_ in specs}
    for _ in range(args.rounds):
        for label, tree, recipe, overrides in specs:
            cached = "feature_source=cached" in overrides or "cached" in Path(recipe).name
            cmd = [sys.executable, __file__, "--worker", "--root", str(tree), "--recipe", recipe, "--steps",
                   str(args.steps), "--warmup", str(args.warmup), "--overrides", overrides,
                   "--dataset", args.features if cached else str(tokenized)]  # fmt: skip
            env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env, check=False)
            if out.returncode != 0:
                print(f"{label} failed:\n{out.stderr[-3000:]}")
                continue
            results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {label}: {results[label][-1]}", flush=True)
    return results


def _print_table(results: dict[str, list[dict]]) -> None:
    print(f"\n{'run':<10}{'s/step':>9}{'slots/step':>12}{'slots/s':>10}{'x first':>9}{'peak GiB':>10}")
    base = None
    for label, runs in results.items():
        if not runs:
            continue
        rate = sum(r["slots_per_s"] for r in runs) / len(runs)
        base = base or rate
        print(f"{label:<10}{sum(r['s_per_step'] for r in runs) / len(runs):>9.2f}"
              f"{sum(r['slots_per_step'] for r in runs) / len(runs):>12.0f}{rate:>10.0f}{rate / base:>9.2f}"
              f"{max(r['peak_rss_gib'] for r in runs):>10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
