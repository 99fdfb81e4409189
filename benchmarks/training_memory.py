# Copyright 2026 the hf_retrace authors. Apache-2.0.
"""Peak memory of one DFlash training step per sequence at the Qwen3-4B recipe's shape, on CPU.

The recipe (`training/recipes/qwen3-4b-retrace.yaml`) trains N = 512 blocks of B = 16 on T = 3072 tokens against a
151,936-token vocabulary. This script keeps those four numbers and shrinks the widths (hidden 64, a random tiny
Qwen3 target, cached random features), so what it measures is what grows with N, B, T and V: the block mask, the
attention scores and the draft logits. Each setting runs in its own process; the figure is the process's peak RSS
minus its RSS before the step.

```bash
python benchmarks/training_memory.py                 # grouped forwards + chunked loss vs all-at-once
python benchmarks/training_memory.py --draft-vocab 32768
```
"""

import argparse
import json
import resource
import subprocess
import sys

import torch


def _step(args) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hf_retrace import ReTraceDrafterModel
    from hf_retrace.trainer.draft_vocab import TrainingDraftHead
    from hf_retrace.trainer.losses import loss_decay_weights
    from hf_retrace.trainer.objective import LossSettings, dflash_training_step

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=False,
    )).eval().requires_grad_(False)  # fmt: skip
    drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=args.block_size)
    if args.draft_vocab:
        drafter.set_draft_vocab(torch.randperm(args.vocab)[: args.draft_vocab].tolist())
    head = TrainingDraftHead.from_lm_head(target.get_output_embeddings(), drafter.draft_vocab_ids)
    ids = torch.randint(0, args.vocab, (1, args.seq_len))
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, : args.seq_len // 8] = 0
    features = torch.randn(1, args.seq_len, 64 * len(drafter.config.target_layer_ids), dtype=torch.bfloat16)
    settings = LossSettings(head, loss_decay_weights(args.block_size, 7.0), chunk_rows=args.chunk_rows)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = dflash_training_step(
        drafter, target, ids, mask, loss_mask, num_anchors=args.num_anchors, loss=settings, features=features,
        max_blocks_per_forward=args.max_blocks_per_forward,
    )  # fmt: skip
    out.loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"step_peak_gib": (peak - before) / 2**20, "blocks": out.metrics["blocks"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--draft-vocab", type=int, default=None)
    parser.add_argument("--single", help=argparse.SUPPRESS)  # internal: "max_blocks,chunk_rows"
    args = parser.parse_args(argv)
    if args.single:
        blocks, rows = (int(x) if x != "all" else None for x in args.single.split(","))
        args.max_blocks_per_forward, args.chunk_rows = blocks, rows or 10**9
        print(json.dumps(_step(args)))
        return
    print(f"N={args.num_anchors} B={args.block_size} T={args.seq_len} V={args.vocab} draft vocab={args.draft_vocab}")
    print(f"{'setting':<46}{'peak GiB / row':>15}")
    settings = {
        "all blocks in one forward, one [rows, V] logits": "all,all",
        "64 blocks per forward, 4096-row logit chunks": "64,4096",
        "32 blocks per forward, 1024-row logit chunks": "32,1024",
    }
    for name, single in settings.items():
        cmd = [sys.executable, __file__, "--single", single, "--num-anchors", str(args.num_anchors), "--block-size",
               str(args.block_size), "--seq-len", str(args.seq_len), "--vocab", str(args.vocab)]  # fmt: skip
        if args.draft_vocab:
            cmd += ["--draft-vocab", str(args.draft_vocab)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(f"{name:<46}{'failed: ' + out.stderr.strip().splitlines()[-1][:80]:>15}")
            continue
        print(f"{name:<46}{json.loads(out.stdout.strip().splitlines()[-1])['step_peak_gib']:>15.2f}")


if __name__ == "__main__":
    main()
