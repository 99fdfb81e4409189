"""`hf-retrace analyze`: how often a drafter's REJECTED suffix still predicts the target continuation (the paper's
motivating statistic; DFlash-b16 on Qwen3: 30.4% top-1, 75.2% top-5).

Usage:

    hf-retrace analyze --drafter drafters/smollm2-b16[:off] --prompt-sets gsm_symbolic:20 --max-new-tokens 256

Alignment (`docs/design.md`, "A cycle"): round r has its anchor (last committed token) at absolute position p; drafted slot j
(1..B-1) predicts the token AT p+j. The target accepts d1..dn and rejects slot n+1. After generation the committed
greedy sequence `s` is known, so n is the number of leading slots with `argmax_j == s[p+j]`, and for every slot
j >= n+2 with p+j inside the generated text we ask whether `s[p+j]` is the drafter's top-1 / within its top-k.
Rounds without a rejection inside the text (full acceptance, or the text ended first) contribute no slot.
The drafter's logits are captured with a forward hook (its final states through the target's lm head, as the
candidate generator computes them); n is cross-checked against the generator's own acceptance counts.
"""

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..cli import check_exists
from ..data.prompts import EVAL_SEED_OFFSET
from ..models.draft_head_retrace import draft_lm_head
from .methods import load_drafter, split_retrace_mode
from .run import DTYPES, encode_prompt_set, load_target, parse_prompt_sets, prompt_set_label, torch_threads


PAPER_REFERENCE = "paper (DFlash-b16 on Qwen3): top-1 30.4%, top-5 75.2%"


@dataclass
class DraftRound:
    """One drafter forward: anchor position p, the greedy drafts of slots 1..B-1 and their top-k token ids."""

    anchor_position: int
    draft_ids: list[int]  # [B-1]
    topk_ids: list[list[int]]  # [B-1, k], best first


@dataclass
class AgreementCounts:
    """Rejected-suffix agreement, summed over rounds. `by_distance[d]` counts slots d = j - (n+1) after the first
    rejection as `[slots, top1, topk]`."""

    rounds: int = 0
    rounds_with_suffix: int = 0
    slots: int = 0
    top1: int = 0
    topk: int = 0
    by_distance: dict[int, list[int]] = field(default_factory=dict)

    @property
    def top1_percent(self) -> float | None:
        return 100.0 * self.top1 / self.slots if self.slots else None

    @property
    def topk_percent(self) -> float | None:
        return 100.0 * self.topk / self.slots if self.slots else None

    def add(self, other: "AgreementCounts") -> None:
        for name in ("rounds", "rounds_with_suffix", "slots", "top1", "topk"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for distance, counts in other.by_distance.items():
            mine = self.by_distance.setdefault(distance, [0, 0, 0])
            self.by_distance[distance] = [a + b for a, b in zip(mine, counts)]

    def to_dict(self) -> dict:
        by_distance = {d: dict(zip(("slots", "top1", "topk"), c)) for d, c in sorted(self.by_distance.items())}
        return asdict(self) | {
            "by_distance": by_distance, "top1_percent": self.top1_percent, "topk_percent": self.topk_percent
        }  # fmt: skip


def num_accepted(round_: DraftRound, sequence: list[int]) -> int:
    """n: leading drafted slots equal to the committed tokens (slot j is compared with `sequence[p + j]`)."""
    p, n = round_.anchor_position, 0
    while n < len(round_.draft_ids) and p + n + 1 < len(sequence) and round_.draft_ids[n] == sequence[p + n + 1]:
        n += 1
    return n


def round_agreement(round_: DraftRound, sequence: list[int]) -> AgreementCounts:
    """Agreement of one round's rejected suffix (slots j >= n+2 inside the text) with the committed tokens.

    Worked example, B = 6 (slots 1..5), anchor p = 2, sequence `[10, 11, 20, 21, 22, 23, 24, 25]`: drafts
    `[21, 99, ...]` give n = 1 (slot 2, position 4, rejected: 99 != 22); slots 3, 4, 5 are compared with
    positions 5, 6, 7, i.e. tokens 23, 24, 25, at distances 1, 2, 3 from the first rejection.
    """
    counts = AgreementCounts(rounds=1)
    p, n = round_.anchor_position, num_accepted(round_, sequence)
    if n == len(round_.draft_ids) or p + n + 1 >= len(sequence):  # full acceptance, or the text ended first
        return counts
    for j in range(n + 2, len(round_.draft_ids) + 1):
        if p + j >= len(sequence):
            break
        target, candidates = sequence[p + j], round_.topk_ids[j - 1]
        hit1, hitk = int(candidates[0] == target), int(target in candidates)
        counts.slots, counts.top1, counts.topk = counts.slots + 1, counts.top1 + hit1, counts.topk + hitk
        bucket = counts.by_distance.setdefault(j - n - 1, [0, 0, 0])
        bucket[0], bucket[1], bucket[2] = bucket[0] + 1, bucket[1] + hit1, bucket[2] + hitk
    counts.rounds_with_suffix = int(counts.slots > 0)
    return counts


class DraftRecorder:
    """Forward hook on the drafter: per forward, the anchor position and the top-k of the draft logits (final states
    of slots 1..B-1 through the target's lm head)."""

    def __init__(self, drafter, lm_head: torch.nn.Module, top_k: int):
        self.lm_head, self.top_k, self.rounds = lm_head, top_k, []
        self.block_size = drafter.config.block_size
        self._handle = drafter.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output):
        position_ids = kwargs["position_ids"]  # [1, C + B]: context positions, then the block p .. p+B-1
        states = output.last_hidden_state[0, 1:].to(self.lm_head.weight.device, self.lm_head.weight.dtype)
        logits = self.lm_head(states).float()  # [B-1, V]
        self.rounds.append(
            DraftRound(
                anchor_position=int(position_ids[0, -self.block_size]),
                draft_ids=logits.argmax(dim=-1).tolist(),
                topk_ids=logits.topk(self.top_k, dim=-1).indices.tolist(),
            )
        )

    def remove(self) -> None:
        self._handle.remove()


def analyze_generation(target, drafter, input_ids: torch.LongTensor, max_new_tokens: int, top_k: int = 5):
    """Greedy speculative decoding of one prompt with `drafter`; returns its `AgreementCounts`. Every cycle is drafted
    and verifies the whole block for the analysis (the drafter's `num_assistant_tokens`, confidence stop, prompt and
    datastore lookup are off meanwhile, and restored after), so each round is seen to its end.

    Raises `RuntimeError` when the recomputed acceptance disagrees with the generator's (an alignment bug).
    """
    # the head the generator scores drafts with (a bf16 copy when `draft_logits_dtype` says so): near-tie argmaxes
    # of another head would disagree with the drafts that were verified
    head = draft_lm_head(
        target.get_output_embeddings(), drafter.generation_config.draft_logits_dtype,
        getattr(drafter, "draft_vocab_ids", None),
    )  # fmt: skip
    recorder = DraftRecorder(drafter, head, top_k)
    config = drafter.generation_config
    settings = ("num_assistant_tokens", "assistant_confidence_threshold", "prompt_lookup_num_tokens",
                "datastore_num_tokens")  # fmt: skip
    saved = {name: getattr(config, name, None) for name in settings}
    try:
        for name in settings:
            setattr(config, name, None)
        output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=drafter,
                                 do_sample=False, max_new_tokens=max_new_tokens)  # fmt: skip
    finally:
        recorder.remove()
        for name, value in saved.items():
            setattr(config, name, value)
    sequence = output[0].tolist()
    accepted = [n - 1 for n in drafter.last_generation_stats.acceptance_lengths]
    if len(accepted) != len(recorder.rounds):
        raise RuntimeError(f"{len(recorder.rounds)} drafter forwards but {len(accepted)} verification cycles")
    counts = AgreementCounts()
    for r, (round_, n) in enumerate(zip(recorder.rounds, accepted)):
        inside = round_.anchor_position + len(round_.draft_ids) < len(sequence)  # block not cut by the text's end
        if inside and num_accepted(round_, sequence) != n:
            raise RuntimeError(
                f"round {r} (anchor {round_.anchor_position}): the committed text implies "
                f"{num_accepted(round_, sequence)} accepted drafts, the generator counted {n}"
            )
        counts.add(round_agreement(round_, sequence))
    return counts


def render_table(per_set: dict[str, AgreementCounts], title: str, top_k: int) -> str:
    lines = [
        title,
        "",
        f"| prompt set | rounds | rounds with a rejected suffix | suffix slots | top-1 % | top-{top_k} % |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, c in per_set.items():
        top1 = "n/a" if c.top1_percent is None else f"{c.top1_percent:.1f}"
        topk = "n/a" if c.topk_percent is None else f"{c.topk_percent:.1f}"
        lines.append(f"| {name} | {c.rounds} | {c.rounds_with_suffix} | {c.slots} | {top1} | {topk} |")
    return "\n".join(lines + ["", PAPER_REFERENCE]) + "\n"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-retrace analyze", description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="drafter folder, optionally FOLDER:MODE (retrace_mode)")
    parser.add_argument("--target", default="default", help="`default` (SmolLM2-135M-Instruct) or a model folder")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt-sets", default="gsm_symbolic:20")
    parser.add_argument("--prompt-seed", type=int, default=EVAL_SEED_OFFSET)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--output-dir", default=None, help="also write analysis.json and analysis.md there")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    check_exists(split_retrace_mode(args.drafter)[0], "--drafter", "drafter folder")  # before the target loads
    with torch_threads(args.num_threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype]
    target, tokenizer = load_target(args.target, dtype, args.device)
    folder, mode = split_retrace_mode(args.drafter)
    drafter = load_drafter(folder, mode, dtype, target.device)
    per_set, pooled = {}, AgreementCounts()
    for name, count in parse_prompt_sets(args.prompt_sets):
        counts = AgreementCounts()
        for input_ids in encode_prompt_set(name, count, tokenizer, args.prompt_seed):
            counts.add(
                analyze_generation(target, drafter, input_ids.to(target.device), args.max_new_tokens, args.top_k)
            )
        per_set[prompt_set_label(name)] = counts
        pooled.add(counts)
    per_set["pooled"] = pooled
    title = (
        f"Rejected-suffix agreement: drafter `{folder}` (retrace_mode {drafter.config.retrace_mode}, block "
        f"{drafter.config.block_size}), target `{args.target}` ({args.dtype}), greedy, max_new_tokens "
        f"{args.max_new_tokens}. Slots after the first rejected slot whose target token is the drafter's top-1 / "
        f"within its top-{args.top_k}, pooled over slots."
    )
    table = render_table(per_set, title, args.top_k)
    print(table)
    if args.output_dir is not None:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "run": vars(args) | {"retrace_mode": drafter.config.retrace_mode},
            "top_k": args.top_k,
            "results": {name: c.to_dict() for name, c in per_set.items()},
            "paper": PAPER_REFERENCE,
        }
        (out / "analysis.json").write_text(json.dumps(payload, indent=2) + "\n")
        (out / "analysis.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
