"""The drafter campaign in one call on a lent GPU machine (experiments/gpu/README.md), within a fixed time budget:

1. grow the pool: the target answers the carried prompts (`.gpu/prompts.npz`, from `export_prompts.py`) greedily,
   in fp32, batch kept full (`build_pool`), for `--generate-minutes`;
2. continue the shipped drafter on the whole pool, the committed rows and the new ones, with the target computing the
   features in every step (`training/recipes/smollm2-135m-dflash-gpu.yaml`), for `--train-minutes`: a short probe
   at learning rate 0 times a step, and `max_steps` is what fits, so the cosine schedule ends on time;
3. write under `--out` what comes back (at most 8 files of 16 MiB): the new token shards as soon as generation ends,
   then the drafter in bf16, each as one tar split under 15 MiB, and the training log.

    python experiments/gpu/campaign.py --out "$OUT"                         # on the GPU machine, via campaign.sh
    python experiments/gpu/campaign.py --out /tmp/smoke --device cpu --smoke   # the same steps, tiny, on a CPU

Every step logs with a timestamp, and a failed step leaves what the earlier ones produced in `--out`.
"""

import argparse
import dataclasses
import json
import shutil
import tarfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback

from hf_retrace.data.assets import load_default_target
from hf_retrace.data.continuous_generation import PromptItem
from hf_retrace.data.pool import build_pool, load_pool_dataset
from hf_retrace.scripts.build_pool import stop_and_pad_ids
from hf_retrace.scripts.train import build_trainer, make_parser


ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "training" / "recipes" / "smollm2-135m-dflash-gpu.yaml"
RETURNED_FILE_BYTES = 15 * 2**20  # a returned file may have 16 MiB


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def load_prompt_items(path: Path, limit: int | None) -> list[PromptItem]:
    """The carried prompts, in stream order (indices are positions in this file, not in the committed pool)."""
    with np.load(path) as data:
        bounds = np.concatenate([[0], np.cumsum(data["lengths"])])
        tokens, sources = data["tokens"].astype(np.int64), [str(s) for s in data["source"]]
    count = len(sources) if limit is None else min(limit, len(sources))
    return [PromptItem(i, sources[i], tokens[bounds[i] : bounds[i + 1]].tolist()) for i in range(count)]


def generate(target, tokenizer, items: list[PromptItem], pool_dir: Path, args) -> None:
    eos, pad = stop_and_pad_ids(target, tokenizer)
    total = build_pool(
        target, items, pool_dir, None, eos_token_ids=eos, layer_ids=[], target_name="default",
        batch_size=args.batch_size, max_new_tokens=256, shard_rows=args.shard_rows,
        max_seconds=60 * args.generate_minutes, pad_token_id=pad,
    )  # fmt: skip
    log(f"generated {total} response tokens into {pool_dir}")


def training_pool(new_pool: Path, committed: Path, folder: Path) -> Path:
    """One pool folder of links: the new shards first, then the committed ones, so that the last rows, the held-out
    split, are the committed pool's newest (the rows round 6 holds out)."""
    shutil.rmtree(folder, ignore_errors=True)
    tokens = folder / "tokens"
    tokens.mkdir(parents=True)
    for prefix, pool in (("0", new_pool), ("1", committed)):
        for k, shard in enumerate(sorted((pool / "tokens").glob("shard_*.npz"))):
            (tokens / f"shard_{prefix}{k:05d}.npz").symlink_to(shard.resolve())
    return folder


class StopAtDeadline(TrainerCallback):
    """Stops training (and lets it save) once `deadline` (a `time.monotonic()` value) has passed: a guard in case the
    probe's step time was optimistic."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() > self.deadline:
            log(f"deadline reached at step {state.global_step} of {state.max_steps}: stopping")
            control.should_training_stop = True


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.monotonic())


def seconds_per_step(script_args, training_args, model_args, target, dataset, steps: int) -> float:
    """Times `steps` optimizer steps of the run's own configuration at learning rate 0 (the drafter is unchanged)."""
    probe_args = dataclasses.replace(
        training_args, max_steps=steps, learning_rate=0.0, eval_on_start=False, logging_steps=steps,
        output_dir=f"{training_args.output_dir}-probe",
    )  # fmt: skip
    trainer = build_trainer(script_args, probe_args, model_args, target=target, dataset=dataset)
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    del trainer  # its optimizer and drafter copy
    warm = timer.times[1:]  # the first step pays for warm-up (allocations, kernel selection)
    return (warm[-1] - warm[0]) / max(len(warm) - 1, 1)


def train(target, pool: Path, work: Path, args) -> object:
    overrides = ["--config", str(RECIPE), "--dataset_name", str(pool), "--output_dir", str(work / "drafter")]
    if args.device == "cpu":
        overrides += ["--use_cpu", "true", "--bf16", "false", "--dataloader_num_workers", "0"]
    script_args, training_args, model_args = make_parser().parse_args_and_config(overrides + args.train_args)
    start = time.monotonic()
    dataset = load_pool_dataset(pool, training_args.max_length)
    log(f"training set: {len(dataset)} rows ({time.monotonic() - start:.0f} s to load)")
    per_step = seconds_per_step(script_args, training_args, model_args, target, dataset, args.probe_steps)
    budget = 60 * args.train_minutes - (time.monotonic() - start) - 2 * args.eval_seconds
    max_steps = max(1, int(budget / per_step))
    log(f"probe: {per_step:.3f} s a step -> max_steps {max_steps} in {budget:.0f} s")
    training_args = dataclasses.replace(training_args, max_steps=max_steps, eval_on_start=False)
    trainer = build_trainer(script_args, training_args, model_args, target=target, dataset=dataset)
    trainer.add_callback(StopAtDeadline(start + 60 * args.train_minutes - args.eval_seconds))
    before = trainer.evaluate()
    log(f"held-out before: {before}")
    trainer.train()
    after = trainer.evaluate()
    log(f"held-out after {trainer.state.global_step} steps: {after}")
    trainer.state.log_history.append({"eval_before": before, "eval_after": after, "seconds_per_step": per_step})
    return trainer


def save_split(files: list[Path], archive: Path, out: Path) -> None:
    """`files` as one tar, written to `out` in parts under the returned-file limit (`<archive name>.partN`)."""
    with tarfile.open(archive, "w") as tar:
        for path in files:
            tar.add(path, arcname=path.name)
    data = archive.read_bytes()
    for k in range(0, len(data), RETURNED_FILE_BYTES):
        (out / f"{archive.name}.part{k // RETURNED_FILE_BYTES}").write_bytes(data[k : k + RETURNED_FILE_BYTES])
    log(f"{len(files)} files, {len(data) / 2**20:.1f} MiB, in {out}/{archive.name}.part*")


def save_drafter(trainer, work: Path, out: Path) -> None:
    """The drafter in bf16 as one split tar (at most 8 files come back: the drafter alone writes 6) and the log."""
    drafter = trainer.accelerator.unwrap_model(trainer.model).to(torch.bfloat16)
    drafter.save_pretrained(work / "drafter-bf16", max_shard_size=RETURNED_FILE_BYTES)
    files = [f for f in sorted((work / "drafter-bf16").iterdir()) if f.suffix != ".py"]  # remote code: written again
    save_split(files, work / "drafter.tar", out)
    (out / "train_log.json").write_text(json.dumps(trainer.state.log_history, indent=1))


def save_shards(new_pool: Path, out: Path) -> None:
    """The new token shards as one split tar, written as soon as generation ends, so that the rows come back even if
    training is cut short."""
    shards = sorted((new_pool / "tokens").glob("shard_*.npz"))
    if shards:
        save_split(shards, new_pool / "new-shards.tar", out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hf_retrace-gpu"))
    parser.add_argument("--prompts", type=Path, default=ROOT / ".gpu" / "prompts.npz")
    parser.add_argument("--committed-pool", type=Path, default=ROOT / "data" / "smollm2-pool")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--generate-minutes", type=float, default=3.5)
    parser.add_argument("--train-minutes", type=float, default=3.5)
    parser.add_argument("--batch-size", type=int, default=512, help="decoding slots kept full (KV cache ~30 GB at 512)")
    parser.add_argument("--shard-rows", type=int, default=1024)
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--probe-steps", type=int, default=6)
    parser.add_argument("--eval-seconds", type=float, default=15.0, help="what one held-out evaluation may take")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks every step on a CPU in minutes")
    parser.add_argument("train_args", nargs="*", help="recipe overrides after --, e.g. -- --learning_rate 1e-4")
    args = parser.parse_args()
    if args.smoke:
        args.max_prompts, args.batch_size, args.shard_rows, args.probe_steps = 12, 6, 8, 3
        args.generate_minutes, args.train_minutes, args.eval_seconds = 0.5, 2.0, 5.0
        args.train_args = ["--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
                           "--num_anchors", "8", "--max_length", "256", "--eval_num_rows", "4"] + args.train_args  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    log(f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))  # fmt: skip
    target, tokenizer = load_default_target(torch.float32)
    target.to(args.device)
    new_pool = args.work / "new-pool"
    try:  # keep what the earlier steps made: the new rows are worth bringing back on their own
        generate(target, tokenizer, load_prompt_items(args.prompts, args.max_prompts), new_pool, args)
    except Exception:
        log("generation failed:\n" + traceback.format_exc())
    save_shards(new_pool, args.out)
    try:
        trainer = train(target, training_pool(new_pool, args.committed_pool, args.work / "train-pool"), args.work, args)
        save_drafter(trainer, args.work, args.out)
    except Exception:
        log("training failed:\n" + traceback.format_exc())

if __name__ == "__main__":
    main()
