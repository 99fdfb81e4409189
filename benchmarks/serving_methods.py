"""What `benchmarks/serving.py` runs: methods, modes, concurrencies, decodings and the prompts of each block.

Pure, stdlib only (the settings parser and the prompt encoding import hf_retrace lazily), so the tests load it
without a model or vLLM.
"""

import math
from dataclasses import dataclass, field


CARDS = {"dflash": "model_cards/smollm2-135m-dflash", "retrace": "model_cards/smollm2-135m-retrace"}
GROUPS = {"pool_eval": ("gsm_symbolic", "humaneval", "open_ended"), "unseen": ("codeio", "knights_knaves")}
REFERENCES = {"hf": "hf_ar", "vllm": "vllm_ar"}
MODES = ("compiled", "eager")  # vLLM's default (torch.compile) and enforce_eager; transformers has one mode, "hf"
ALL_METHODS = "hf_ar,hf_drafter,vllm_ar,vllm_suffix,vllm_suffix=8,vllm_ngram,vllm_dflash,vllm_retrace"
DEFAULT_NGRAM_TOKENS = 3


@dataclass
class MethodSpec:
    """One `--methods` entry: `engine` is `hf` or `vllm`, `kind` one of ar, drafter, ngram, suffix, dflash;
    `num_speculative_tokens=None` keeps vLLM's default for the method (suffix: its tree depth, 24); `settings` are
    decoding settings written into a copy of the card's `generation_config.json` (drafter cards only); `env` holds
    variables set in the method's vLLM workers (`:env.NAME=VALUE`, e.g. the plugin's `HF_RETRACE_VLLM_*`)."""

    name: str
    engine: str
    kind: str
    card: str | None = None
    num_speculative_tokens: int | None = None
    settings: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    def speculative_config(self, export_dir: str | None = None) -> dict | None:
        """vLLM's `speculative_config` for this method (None: target alone)."""
        k = self.num_speculative_tokens
        if self.kind == "ngram":
            return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
        if self.kind == "suffix":
            return {"method": "suffix"} | ({} if k is None else {"num_speculative_tokens": k})
        if self.kind == "dflash":
            return {"method": "dflash", "model": export_dir, "num_speculative_tokens": k}
        return None


def _parse_k(name: str, value: str, item: str) -> int:
    if not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"expected {name}=K with K >= 1 speculative tokens, got {item!r}")
    return int(value)


def split_settings(item: str) -> tuple[str, dict]:
    """`METHOD[=VALUE]:key=value:...` -> `(METHOD[=VALUE], {key: value})`."""
    from hf_retrace.bench.methods import setting_value  # the same values `hf-retrace bench` reads

    head, *pairs = item.split(":")
    settings = {}
    for pair in pairs:
        key, has_value, text = pair.partition("=")
        if not (key and has_value and text):
            raise ValueError(f"expected :key=value decoding settings after the method in {item!r}, got {pair!r}")
        settings[key] = setting_value(text)
    return head, settings


def parse_methods(text: str) -> list[MethodSpec]:
    """`hf_ar,hf_drafter[=CARD],vllm_ar,vllm_ngram[=K],vllm_suffix[=K],vllm_dflash[=CARD],vllm_retrace[=CARD]`.

    `vllm_suffix=8` is named `vllm_suffix8` (so vLLM's defaults and 8 tokens can run side by side), likewise
    `vllm_ngram=K`; each engine's target-alone method is prepended when that engine is used without it. The drafter
    methods take decoding settings after the card, `vllm_retrace:speculation_policy=fixed`, and are then named with
    their values appended (`vllm_retrace_fixed`); `num_speculative_tokens=K` there sets vLLM's K (default 3), and
    `env.NAME=VALUE` sets a variable in the method's vLLM workers only (an A/B of the plugin's environment switches in
    one run: `vllm_dflash:env.HF_RETRACE_VLLM_LOAD_FALLBACK=0`, named `vllm_dflash_0`).
    """
    specs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        item, settings = split_settings(item)
        name, has_value, value = item.partition("=")
        if settings and name not in ("hf_drafter", "vllm_dflash", "vllm_retrace"):
            raise ValueError(f"only drafter methods take :key=value settings, got {item!r} with {settings}")
        if has_value and not value:
            raise ValueError(f"method {item!r} has an empty value after '='; drop the '=' or give a value")
        if name in ("hf_ar", "vllm_ar") and not has_value:
            specs.append(MethodSpec(name, name.partition("_")[0], "ar"))
        elif name == "hf_drafter":
            specs.append(MethodSpec(name, "hf", "drafter", card=value or CARDS["dflash"]))
        elif name == "vllm_ngram":
            k = _parse_k(name, value, item) if has_value else DEFAULT_NGRAM_TOKENS
            specs.append(MethodSpec(f"{name}{value}", "vllm", "ngram", num_speculative_tokens=k))
        elif name == "vllm_suffix":
            k = _parse_k(name, value, item) if has_value else None
            specs.append(MethodSpec(f"{name}{value}", "vllm", "suffix", num_speculative_tokens=k))
        elif name in ("vllm_dflash", "vllm_retrace"):
            card = value or CARDS[name.partition("_")[2]]
            specs.append(MethodSpec(name, "vllm", "dflash", card=card, num_speculative_tokens=3))
        else:
            raise ValueError(f"unknown method {item!r}; expected one of {ALL_METHODS} (with =CARD or =K where shown)")
        if settings:
            spec = specs[-1]
            spec.name += "".join(f"_{value}" for value in settings.values())
            if spec.engine == "vllm" and "num_speculative_tokens" in settings:  # vLLM's K, not the card's
                spec.num_speculative_tokens = _parse_k(name, str(settings.pop("num_speculative_tokens")), item)
            spec.env = {key[4:]: str(value) for key, value in settings.items() if key.startswith("env.")}
            if spec.env and spec.engine != "vllm":
                raise ValueError(f"env.NAME=VALUE sets a vLLM worker's environment; {item!r} runs in transformers")
            spec.settings = {key: value for key, value in settings.items() if not key.startswith("env.")}
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"method names must be unique, got {names}")
    for engine, reference in reversed(REFERENCES.items()):
        if any(s.engine == engine for s in specs) and reference not in names:
            specs.insert(0, MethodSpec(reference, engine, "ar"))
    return specs


def parse_concurrency(text: str, flag: str = "--concurrency") -> list[int]:
    """`1,8` -> `[1, 8]` (unique, ascending, each >= 1)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers like 1,8, got {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"{flag} needs integers >= 1, got {text!r}")
    return values


def parse_modes(text: str) -> list[str]:
    """`compiled,eager` -> `["compiled", "eager"]` (in the order given, unique)."""
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes takes a comma-separated subset of {','.join(MODES)}, got {text!r}")
    return modes


@dataclass
class Prompt:
    group: str
    prompt_set: str
    index: int
    token_ids: list[int]

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.group, self.prompt_set, self.index)


def prompts_per_set(group: str, concurrency: int, base: int, factor: int) -> int:
    """Prompts of each set of `group` at `concurrency`: `base`, raised so that the group holds at least `factor` x
    `concurrency` prompts (every request of a concurrent batch a distinct prompt, and at least `factor` batches)."""
    return max(base, math.ceil(factor * concurrency / len(GROUPS[group])))


@dataclass
class PromptPlan:
    """How many prompts of each set each pass reads. Greedy passes at concurrency C read the first
    `greedy(group, C)` prompts of each set; sampled passes read the next ones (disjoint from every greedy prompt, so
    an engine that learns from its requests, as `suffix` does, never meets a sampled prompt's greedy answer)."""

    base: int
    factor: int
    concurrencies: list[int]
    sampled_concurrencies: list[int]

    def greedy(self, group: str, concurrency: int) -> int:
        return prompts_per_set(group, concurrency, self.base, self.factor)

    def sampled(self, group: str, concurrency: int) -> int:
        return self.greedy(group, concurrency) if concurrency in self.sampled_concurrencies else 0

    def offset(self, group: str) -> int:
        """Index of the first sampled prompt of each set of `group`."""
        return max(self.greedy(group, c) for c in self.concurrencies)

    def total(self, group: str) -> int:
        return self.offset(group) + max([self.sampled(group, c) for c in self.sampled_concurrencies] or [0])

    def pick(self, prompts: list[Prompt], concurrency: int, sampled: bool) -> list[Prompt]:
        """The prompts of one pass, set by set in `GROUPS` order."""
        picked = []
        for p in prompts:
            start = self.offset(p.group) if sampled else 0
            count = self.sampled(p.group, concurrency) if sampled else self.greedy(p.group, concurrency)
            if start <= p.index < start + count:
                picked.append(p)
        return picked


def encode_prompts(tokenizer, plan: PromptPlan, seed: int) -> list[Prompt]:
    """Every prompt the plan reads, chat template applied once (the same token ids go to both engines)."""
    from hf_retrace.bench.run import encode_prompt_set

    prompts = []
    for group, sets in GROUPS.items():
        for name in sets:
            encoded = encode_prompt_set(name, plan.total(group), tokenizer, seed)
            if len(encoded) < plan.total(group):
                raise ValueError(f"prompt set {name} has {len(encoded)} prompts, the plan needs {plan.total(group)}")
            prompts += [Prompt(group, name, i, ids[0].tolist()) for i, ids in enumerate(encoded)]
    return prompts


def too_long(prompts: list[Prompt], max_new_tokens: int, max_model_len: int) -> str | None:
    """What is wrong when a prompt and its `max_new_tokens` do not fit vLLM's `max_model_len` (vLLM would refuse the
    request and end the block's engine after its other passes ran); `None` when all fit."""
    over = [p for p in prompts if len(p.token_ids) + max_new_tokens > max_model_len]
    if not over:
        return None
    names = ", ".join(f"{p.prompt_set}[{p.index}] ({len(p.token_ids)} tokens)" for p in over)
    longest = max(len(p.token_ids) for p in over) + max_new_tokens
    return (f"{len(over)} prompt(s) and --max-new-tokens {max_new_tokens} exceed --max-model-len {max_model_len}: "
            f"{names}; pass --max-model-len {longest} or more, or fewer prompts (--num-prompts-per-set)")


def chunk_rounds(prompts: list[Prompt], rounds: int) -> list[list[Prompt]]:
    """Cuts the prompts into `rounds` chunks of near-equal size, each mixing every set (prompt k: chunk k % rounds)."""
    rounds = max(1, min(rounds, len(prompts)))
    return [prompts[r::rounds] for r in range(rounds)]


def concurrent_batches(chunk: list[Prompt], concurrency: int, queue: bool = False) -> list[list[Prompt]]:
    """The chunk's prompts in batches submitted at once, each batch of one group only, so a group's rows time its own
    requests (a batch's wall time cannot be split among groups).

    `queue=False`: batches of `concurrency` prompts, each stepped until all of its requests finish. `queue=True`: one
    batch a group; the engine runs `concurrency` of its requests at a time (`max_num_seqs`) and starts a queued one
    as soon as one finishes, as a server under steady load does."""
    batches = []
    for group in dict.fromkeys(p.group for p in chunk):
        prompts = [p for p in chunk if p.group == group]
        size = len(prompts) if queue else concurrency
        batches += [prompts[i : i + size] for i in range(0, len(prompts), size)]
    return batches


def rotated(items: list, k: int) -> list:
    k %= max(len(items), 1)
    return items[k:] + items[:k]
