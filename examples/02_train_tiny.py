"""Train a tiny ReTrace drafter in Python (TRL style), then check it decodes losslessly. Seconds on CPU.

    python examples/02_train_tiny.py
"""

import tempfile

import torch

from hf_retrace import ReTraceConfig, ReTraceDrafterModel, ReTraceTrainer
from hf_retrace.trainer.setup import build_tiny_target, synthetic_dataset


def main():
    target = build_tiny_target(seed=0)  # a seeded random Qwen3 (vocab 128, hidden 32, 4 layers)
    dataset = synthetic_dataset(target, num_examples=32, prompt_length=6, response_length=18, seed=0)
    drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=4)
    with tempfile.TemporaryDirectory() as out:
        args = ReTraceConfig(
            output_dir=out, training_mode="retrace", retrace_mode="corrected", num_anchors=8, max_steps=6,
            per_device_train_batch_size=4, learning_rate=3e-3, beta_warmup_steps=2, logging_steps=2,
            report_to="none", use_cpu=True, save_strategy="no",
        )  # fmt: skip
        ReTraceTrainer(model=drafter, target=target, args=args, train_dataset=dataset).train()

    prompt = torch.tensor([[5, 17, 42, 9, 88, 3]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    got = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter.eval())
    assert got.tolist() == expected.tolist(), "speculative output must equal target greedy output"
    print(f"lossless; tau = {drafter.last_generation_stats.tau:.2f} over "
          f"{len(drafter.last_generation_stats.acceptance_lengths)} cycles")


if __name__ == "__main__":
    main()
