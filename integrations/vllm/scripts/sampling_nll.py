"""Whether speculative sampling in vLLM keeps the target's distribution: the mean negative log-likelihood per
generated token, scored by the target itself at the sampling temperature, for the target alone, the hf-retrace
plugin, and vLLM's own `ngram` and `suffix`. Exact sampling gives the target-alone value within seed-to-seed noise.

    .venv-vllm/bin/python integrations/vllm/scripts/sampling_nll.py --drafter EXPORTED_DIR --prompts 8 --seeds 2

Prompts are the first `--prompts` of a fixed list of chat requests (the target's chat template applied). Every
request has its own seed (`seed + request index`), so a method's spread over `--seeds` runs is sampling noise only.
Scoring runs in transformers on the token ids vLLM returned (fp32, `log_softmax(logits / T)`). Without `--drafter`
the plugin row is skipped. Prints one JSON object: per method, the NLL of each seed run and their mean.
"""

import argparse
import gc
import json
import os


PROMPTS = [
    "What is the capital of France?", "Explain gravity in two sentences.", "Write a haiku about the sea.",
    "Give me three tips for learning to cook.", "What does a compiler do?", "Describe a cat to someone who has "
    "never seen one.", "Why is the sky blue?", "Summarise the plot of a heist film you invent.",
    "How do vaccines work?", "Write a short thank-you note to a neighbour.", "What is a prime number?",
    "Suggest a name for a bakery and say why.",
]  # fmt: skip
SPECS = {
    "target": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


def generate(target: str, spec, prompts: list[str], seeds: list[int], temperature: float, max_tokens: int):
    """Token ids `(prompt_ids, completion_ids)` per prompt and seed run, from one vLLM engine."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
              speculative_config=spec)  # fmt: skip
    runs = []
    for seed in seeds:
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed * 1000 + i)
                  for i in range(len(prompts))]  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs])
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return runs


def mean_nll(model, pairs, temperature: float) -> float:
    """Mean over all generated tokens of `-log softmax(logits / T)[token]` under `model` (a transformers causal LM).

    Args:
        pairs: `(prompt_ids, completion_ids)` per request.
    """
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, completion in pairs:
            if not completion:
                continue
            ids = torch.tensor([prompt + completion])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [n, V]: predicts each completion token
            logp = (logits / temperature).log_softmax(-1)
            total -= float(logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).sum())
            count += len(completion)
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.expanduser("~/.cache/hf_retrace/smollm2-135m-instruct"))
    parser.add_argument("--drafter", help="an `hf-retrace export --format vllm` folder (the plugin row)")
    parser.add_argument("--methods", default="target,plugin,ngram,suffix")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in PROMPTS[: args.prompts]]  # fmt: skip
    specs = dict(SPECS)
    if args.drafter:
        specs["plugin"] = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": 3}
    seeds = list(range(args.seeds))
    runs = {m: generate(args.target, specs[m], prompts, seeds, args.temperature, args.max_tokens)
            for m in args.methods.split(",") if m in specs}  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.target, torch_dtype="float32").eval()
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens, "temperature": args.temperature, "nll": {}}
    for method, method_runs in runs.items():
        values = [round(mean_nll(model, pairs, args.temperature), 4) for pairs in method_runs]
        result["nll"][method] = {"per_seed": values, "mean": round(sum(values) / len(values), 4)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
