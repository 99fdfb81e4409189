"""What the speculation policy itself costs per engine step, at batch 1, 8 and 32: the Python both engines run between
two target forwards (the sources' proposals, the goodput plan, the drafts' count, learning from the outcome and the
committed tokens), with no model in the loop.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/policy_overhead.py [--concurrency 1,8,32] [--steps 200]

The policy is the shipped card's (`model_cards/smollm2-135m-dflash`: prompt lookup, its 1.75M-token datastore and the
online datastore, 8 tokens each, `speculation_policy="goodput"`), over a fixed step-cost model: up to 16 rows and a
16-slot drafter block, the curve vLLM's start-up profile measured on a 2-core AVX2 host (47.6 ms for 1 row to 119.3 ms
for 16, 9.9 ms for the block); past them, rounded extrapolations, enough to rank the plans alike on every run.
Requests start from prompts of the unseen families (codeio, knights_knaves; ~1,000 tokens), and each step commits a
seeded stand-in for the target's answer: a run of 1 to 4 prompt tokens (copying, as these families do) or one random
token, and the drafter's confidences are seeded draws. So the work per step is realistic (lookups match, the online
index grows, both plan stages run) and identical from run to run.

Prints ms per step (median of `--repeats` timed runs after a warm-up) and per request, and a digest of every plan
taken: a change that only makes the policy faster must leave the digest as it was.
"""

import argparse
import hashlib
import statistics
import time
import types
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, GenerationConfig

from hf_retrace import ReTraceDrafterModel
from hf_retrace.data.assets import ensure_default_target
from hf_retrace.data.prompts import EVAL_SEED_OFFSET, load_prompts
from hf_retrace.models.cost_model_retrace import StepCostModel
from hf_retrace.models.online_datastore_retrace import OnlineDatastore
from hf_retrace.models.sources_retrace import candidate_sources
from hf_retrace.models.speculation_retrace import SpeculationPolicy


CARD = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-dflash"
SETTINGS = {"speculation_policy": "goodput", "num_assistant_tokens": 8, "prompt_lookup_num_tokens": 8,
            "datastore_num_tokens": 8, "online_datastore_num_tokens": 8}  # fmt: skip
TARGET_MS = [(1, 47.6), (2, 55.6), (4, 62.3), (8, 81.4), (16, 119.3), (32, 196.0), (64, 350.0), (128, 650.0)]
DRAFTER_MS = [(16, 9.9), (64, 20.0), (128, 35.0), (256, 65.0), (512, 125.0)]


def build_policy(drafter) -> SpeculationPolicy:
    """The card's goodput policy over the fixed cost curve, with a fresh estimator and online datastore."""
    settings = drafter.decoding_settings(GenerationConfig(**SETTINGS))

    def online_datastore(max_bytes: int) -> OnlineDatastore:  # a fresh online index per run
        return OnlineDatastore(max_bytes=max_bytes)

    resources = types.SimpleNamespace(datastore=drafter.datastore, online_datastore=online_datastore)
    costs = StepCostModel.fit([(r, ms / 1000) for r, ms in TARGET_MS], [(s, ms / 1000) for s, ms in DRAFTER_MS])
    return SpeculationPolicy(settings, candidate_sources(settings, resources), drafter.config.block_size, costs,
                             whole_batch_drafter=True)  # fmt: skip


class Simulation:
    """`concurrency` requests stepped together; `step()` is one engine step of policy work."""

    def __init__(self, policy: SpeculationPolicy, prompts: list[np.ndarray], seed: int):
        self.policy, self.prompts, self.rng = policy, prompts, np.random.default_rng(seed)
        self.tokens = {}
        for i, prompt in enumerate(prompts):
            policy.start(i, prompt)
            self.tokens[i] = prompt
        self.digest = hashlib.sha256()

    def _answer(self, i: int) -> np.ndarray:
        prompt = self.prompts[i]
        if self.rng.random() < 0.6:
            start = int(self.rng.integers(0, len(prompt) - 8))
            return prompt[start : start + int(self.rng.integers(1, 5))]
        return np.array([self.rng.integers(0, 49152)], dtype=np.int64)

    def step(self) -> None:
        plan = self.policy.plan([(i, tokens, 8) for i, tokens in self.tokens.items()])
        confidences = {rid: self.rng.random(15) for rid in plan.drafting}
        counts = self.policy.num_drafts(plan, confidences) if confidences else {}
        self.digest.update(repr((sorted(plan.actions.items()), sorted(counts.items()))).encode())
        for i in self.tokens:
            self.policy.outcome(i, int(self.rng.integers(0, 3)))
            new = self._answer(i)
            self.policy.commit(i, new)
            self.tokens[i] = np.concatenate([self.tokens[i], new])


def timed_run(drafter, prompts, steps: int, warmup: int) -> tuple[float, str]:
    """Seconds per step over `steps` after `warmup`, and the digest of every plan of the run."""
    simulation = Simulation(build_policy(drafter), prompts, seed=0)
    for _ in range(warmup):
        simulation.step()
    start = time.perf_counter()
    for _ in range(steps):
        simulation.step()
    return (time.perf_counter() - start) / steps, simulation.digest.hexdigest()[:16]


def unseen_prompts(count: int) -> list[np.ndarray]:
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_target())
    conversations = []
    for name in ("codeio", "knights_knaves"):
        conversations += load_prompts(name, (count + 1) // 2, EVAL_SEED_OFFSET)
    out = []
    for messages in conversations[:count]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        out.append(np.asarray(ids if isinstance(ids, list) else ids["input_ids"], dtype=np.int64))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--steps", type=int, default=200, help="timed steps a run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    drafter = ReTraceDrafterModel.from_pretrained(CARD)
    print("| requests | ms / step | ms / request | plan digest |\n|---:|---:|---:|---|")
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        prompts = unseen_prompts(concurrency)
        runs = [timed_run(drafter, prompts, args.steps, args.warmup) for _ in range(args.repeats)]
        digests = {digest for _, digest in runs}
        if len(digests) != 1:
            raise RuntimeError(f"the policy is not deterministic here: digests {digests}")
        seconds = statistics.median(s for s, _ in runs)
        print(f"| {concurrency} | {seconds * 1e3:.2f} | {seconds * 1e3 / concurrency:.3f} | {digests.pop()} |")


if __name__ == "__main__":
    main()
