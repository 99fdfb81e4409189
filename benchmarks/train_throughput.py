# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Training throughput of a recipe: DFlash steps vs ReTrace steps (faithful and teacher-forced verification features).

Each mode runs in its own process (so peak memory is per mode) for `--warmup + --steps` full optimizer steps of
[`ReTraceTrainer`] on fixed-shape random batches (prompt = first quarter, response = the rest), and reports the
timed steps' training tokens/s, blocks/s and peak memory (CUDA peak allocated on GPU, peak RSS on CPU).

Usage:
    python benchmarks/train_throughput.py                                   # SmolLM2 recipe, 3 timed steps each
    python benchmarks/train_throughput.py --config training/recipes/tiny.yaml --batch-size 4 --seq-len 32
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback


ROOT = Path(__file__).resolve().parents[1]
MODES = {  # name -> recipe overrides
    "dflash": {"training_mode": "dflash"},
    "retrace": {"training_mode": "retrace", "verification_features": "faithful"},
    "retrace-teacher-forced": {"training_mode": "retrace", "verification_features": "teacher_forced"},
}


class _StepTimer(TrainerCallback):
    def __init__(self, trainer, warmup: int):
        self.trainer, self.warmup, self.times, self.blocks = trainer, warmup, [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.start)
            self.blocks.append(self.trainer._metrics["train"]["blocks"][-1])


def _random_dataset(vocab: int, rows: int, seq_len: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, seq_len // 4 :] = 1
    return Dataset.from_dict({"input_ids": ids.tolist(), "loss_mask": loss_mask.tolist()})


def run_mode(config: str, mode: str, steps: int, warmup: int, batch_size: int, seq_len: int) -> dict:
    """One mode in this process; returns its measurements."""
    sys.path.insert(0, str(ROOT / "training"))
    from train import make_parser

    from hf_retrace.trainer import ReTraceTrainer
    from hf_retrace.training_setup import init_drafter, load_target

    overrides = [f"--{k}={v}" for k, v in MODES[mode].items()]
    _, args, model_args = make_parser().parse_args_and_config(
        ["--config", config, "--output_dir", "/tmp/retrace-throughput", "--max_steps", str(warmup + steps),
         "--save_strategy", "no", "--logging_steps", "100000", "--report_to", "none", "--disable_tqdm", "true",
         "--per_device_train_batch_size", str(batch_size), *overrides]
    )  # fmt: skip
    target, _ = load_target(args.target_name_or_path, args.target_dtype)
    if args.drafter_name_or_path and not Path(args.drafter_name_or_path).exists():
        args.drafter_name_or_path = None  # the recipe's init drafter is not trained yet: time a fresh one
    drafter = init_drafter(args, target, model_args.model_name_or_path)
    vocab = target.config.get_text_config().vocab_size
    dataset = _random_dataset(vocab, batch_size * (warmup + steps), seq_len, args.seed)
    trainer = ReTraceTrainer(model=drafter, target=target, args=args, train_dataset=dataset)
    timer = _StepTimer(trainer, warmup)
    trainer.add_callback(timer)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    seconds = sum(timer.times)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024  # fmt: skip
    return {
        "mode": mode, "steps": len(timer.times), "s_per_step": seconds / len(timer.times),
        "tokens_per_s": batch_size * seq_len * len(timer.times) / seconds, "blocks_per_s": sum(timer.blocks) / seconds,
        "peak_memory_gib": peak / 2**30, "device": str(trainer.args.device), "num_anchors": args.num_anchors,
        "block_size": drafter.config.block_size, "target_layer_ids": drafter.config.target_layer_ids,
    }  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "training" / "recipes" / "smollm2-135m-dflash.yaml"))
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # internal: run one mode in this process
    args = parser.parse_args(argv)
    if args.mode:
        print(json.dumps(run_mode(args.config, args.mode, args.steps, args.warmup, args.batch_size, args.seq_len)))
        return
    print(f"recipe {args.config}: batch {args.batch_size} x {args.seq_len} tokens, {args.steps} timed steps per mode")
    print(f"{'mode':<24}{'s/step':>9}{'tokens/s':>11}{'blocks/s':>10}{'peak GiB':>10}")
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--mode", mode, "--config", args.config, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{mode:<24} failed:\n{out.stderr[-2000:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{mode:<24}{r['s_per_step']:>9.2f}{r['tokens_per_s']:>11.0f}{r['blocks_per_s']:>10.1f}"
              f"{r['peak_memory_gib']:>10.2f}")  # fmt: skip
    print(
        f"(device {r['device']}, block {r['block_size']}, {r['num_anchors']} anchors/sequence, "
        f"target layers {r['target_layer_ids']}; blocks = trained blocks, round 2 for ReTrace)"
    )


if __name__ == "__main__":
    main()
