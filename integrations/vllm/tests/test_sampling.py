"""Sampling through speculation keeps the target's distribution (hf_retrace_vllm/sampler_patch.py).

Two levels:
- vLLM's `RejectionSampler` on CPU, as its engine calls it, on a batch of many identical requests (each one an
  independent trial): the first output token must follow the target's processed distribution `p_0` (temperature,
  top-k, top-p), and the token after an accepted first draft must follow `p_1`. Chi-square against `p` computed
  directly. Without the patch the temperature is read from uninitialised memory and these fail by orders of
  magnitude.
- A vLLM engine: the plugin (a random drafter, drafts mostly rejected, so most tokens come from rejections) on
  sampled requests: the target's mean NLL per token of what it writes stays within plain sampling's seed-to-seed
  spread; greedy and sampled requests mixed in one batch leave the greedy ones token for token as plain greedy.
"""

import math

import pytest
import torch

from conftest import MAX_TOKENS, PROMPTS, close_llm, make_llm
from test_lossless_random import random_folders  # noqa: F401  (the fixture)


V = 64  # a small vocabulary: every token's frequency is measurable
TRIALS = 6000
CHI2_Z = 4.0  # reject at ~ p < 1e-4 (Wilson-Hilferty), so a correct sampler fails once in thousands of runs


def _chi2_threshold(dof: int) -> float:
    """The `1 - alpha` quantile of chi-square with `dof` degrees of freedom, Wilson-Hilferty approximation."""
    c = 2.0 / (9.0 * dof)
    return dof * (1 - c + CHI2_Z * math.sqrt(c)) ** 3


def assert_follows(samples: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    """Chi-square of `samples` `[n]` against `probs` `[V]`, rare cells (expected < 5) pooled into one."""
    n = samples.numel()
    observed = torch.bincount(samples.long(), minlength=probs.numel()).double()
    expected = probs.double() * n
    assert observed[expected == 0].sum() == 0, f"{what}: sampled a token the target gives probability 0"
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < _chi2_threshold(dof), f"{what}: chi2 {chi2:.1f} over {dof} dof (limit {_chi2_threshold(dof):.1f})"


def processed(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The target distribution `[V]` vLLM samples from without speculation: logits / T, then top-k, then top-p."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    z = logits.double() / temperature
    if top_k is not None:
        z = z.masked_fill(z < z.topk(top_k).values[-1], -math.inf)
    if top_p is not None:  # keep the smallest head whose mass reaches top_p
        probs, order = z.softmax(-1).sort(descending=True)
        drop = probs.cumsum(-1) - probs > top_p
        z[order[drop]] = -math.inf
    return z.softmax(-1)


def sampling_metadata(temperatures: list[float], top_k: list[int] | None, top_p: list[float] | None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    t = torch.tensor(temperatures, dtype=torch.float32)
    return SamplingMetadata(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t != 0).all()),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(len(t)), presence_penalties=torch.zeros(len(t)),
        repetition_penalties=torch.ones(len(t)), output_token_ids=[[] for _ in temperatures],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )  # fmt: skip


def verify(logits: torch.Tensor, drafts: list[int], temperatures, top_k=None, top_p=None) -> torch.Tensor:
    """vLLM's CPU `RejectionSampler` on `len(temperatures)` requests with the same `drafts` and target `logits`
    `[len(drafts) + 1, V]` (the last row is the bonus position). Returns its output `[batch, len(drafts) + 1]`."""
    import hf_retrace_vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    hf_retrace_vllm.register()
    current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does at start-up
    batch, k = len(temperatures), len(drafts)
    meta = SpecDecodeMetadata.make_dummy([drafts] * batch, torch.device("cpu"))
    rows = torch.arange(batch * (k + 1)).view(batch, k + 1)
    meta.target_logits_indices = rows[:, :k].reshape(-1).int()
    meta.bonus_logits_indices = rows[:, k].int()
    sampler = RejectionSampler(Sampler())
    md = sampling_metadata(temperatures, top_k and [top_k] * batch, top_p and [top_p] * batch)
    out = sampler(meta, None, logits.repeat(batch, 1).contiguous(), md)
    return out.sampled_token_ids


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 2.0  # [k + 1, V], k = 2 drafts


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, None), (1.0, None, None), (1.0, None, 0.9),
                                                     (0.8, 50, None), (0.7, 50, 0.9)])  # fmt: skip
def test_rejection_sampler_keeps_target_distribution(temperature, top_k, top_p):
    logits = _logits(1)
    p = [processed(row, temperature, top_k, top_p) for row in logits]
    drafts = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely first draft, a second-best second draft
    out = verify(logits, drafts, [temperature] * TRIALS, top_k, top_p)
    assert_follows(out[:, 0], p[0], "first token")
    after = out[out[:, 0] == drafts[0], 1]
    assert after.numel() > TRIALS * p[0][drafts[0]] * 0.9
    assert_follows(after, p[1], "token after an accepted draft")


def test_mixed_greedy_and_sampled_batch():
    logits = _logits(2)
    p0 = processed(logits[0], 1.0, None, None)
    greedy_ids = logits.argmax(-1)
    wrong = int(logits[0].argsort()[-3])  # a first draft greedy rejects
    temperatures = [0.0, 1.0] * (TRIALS // 2)
    out = verify(logits, [wrong, int(greedy_ids[1])], temperatures)
    greedy_rows, sampled_rows = out[0::2], out[1::2]
    assert (greedy_rows[:, 0] == greedy_ids[0]).all() and (greedy_rows[:, 1] == -1).all()
    assert_follows(sampled_rows[:, 0], p0, "sampled rows beside greedy ones")


def _seeded(md, seeds: dict[int, int]):
    """`md` with a fresh seeded generator for each batch row in `seeds`."""
    md.generators = {i: torch.Generator().manual_seed(seed) for i, seed in seeds.items()}
    md.all_random = False
    return md


def test_a_step_without_drafts_samples_as_vllm_without_speculation(monkeypatch):
    """No request has a draft: the rejection sampler's result is vLLM's plain sampler's on the same logits (sampler
    patch, 3.), token for token for greedy and seeded sampled rows alike, without the draft stages; a step with one
    draft, or asking for logprobs, keeps the rejection path."""
    import hf_retrace_vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    hf_retrace_vllm.register()
    current_platform.register_triton_kernel_overrides()
    temperatures = [0.0, 1.0, 0.7, 0.0, 1.3, 1.0]
    seeds = {1: 11, 2: 12, 4: 14, 5: 15}
    batch = len(temperatures)
    logits = torch.randn(batch, V, generator=torch.Generator().manual_seed(3)) * 2.0  # one row a request
    meta = SpecDecodeMetadata.make_dummy([[] for _ in range(batch)], torch.device("cpu"))
    meta.bonus_logits_indices = torch.arange(batch, dtype=torch.int32)  # as the runner lays out zero drafts
    sampler = rejection_sampler.RejectionSampler(Sampler())

    def md():
        return _seeded(sampling_metadata(temperatures, None, None), seeds)

    plain = Sampler()(logits.clone(), md()).sampled_token_ids  # vLLM without a speculative config
    full = rejection_sampler.RejectionSampler.forward.__wrapped__(sampler, meta, None, logits.clone(), md())
    assert rejection_sampler.RejectionSampler.forward.__wrapped__ is not rejection_sampler.RejectionSampler.forward

    def no_draft_stage(*args, **kwargs):
        raise AssertionError("the draft stages ran")

    monkeypatch.setattr(rejection_sampler, "rejection_sample", no_draft_stage)
    out = sampler(meta, None, logits.clone(), md()).sampled_token_ids
    assert out.shape == (batch, 1) and out.dtype == torch.int32
    assert torch.equal(out, plain) and torch.equal(out, full.sampled_token_ids)
    assert torch.equal(out[[0, 3], 0].long(), logits[[0, 3]].argmax(-1))

    one_draft = SpecDecodeMetadata.make_dummy([[5]] + [[] for _ in range(batch - 1)], torch.device("cpu"))
    with pytest.raises(AssertionError, match="draft stages"):
        sampler(one_draft, None, torch.randn(batch + 1, V), md())
    asks_logprobs = md()
    asks_logprobs.max_num_logprobs = 2
    with pytest.raises(AssertionError, match="draft stages"):
        sampler(meta, None, logits.clone(), asks_logprobs)


# (temperature, top_p, top_k) of the engine-level requests: every combination the checks above cover
CONFIGS = [(0.7, None, None), (1.0, None, None), (1.0, 0.9, None), (0.8, None, 50)]
SEEDS = 3
SAMPLED_TOKENS = 32


def _sampled_requests():
    """`(prompt, SamplingParams, config index)` for every prompt, config and seed; each request has its own seed."""
    from vllm import SamplingParams

    requests = []
    for c, (temperature, top_p, top_k) in enumerate(CONFIGS):
        for s in range(SEEDS):
            for i, prompt in enumerate(PROMPTS):
                params = SamplingParams(temperature=temperature, top_p=top_p or 1.0, top_k=top_k or 0,
                                        max_tokens=SAMPLED_TOKENS, seed=1000 * s + 10 * c + i)  # fmt: skip
                requests.append((prompt, params, c, s))
    return requests


def _run(llm, requests, greedy_too: bool):
    """One `generate` call with every sampled request (and, if asked, every prompt greedy, interleaved)."""
    from vllm import SamplingParams

    prompts, params = [r[0] for r in requests], [r[1] for r in requests]
    if greedy_too:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        for i, prompt in enumerate(PROMPTS):  # spread through the batch, between sampled requests
            prompts.insert(i * 9, prompt)
            params.insert(i * 9, greedy)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    greedy_out = [list(o.outputs[0].token_ids) for o, p in zip(outputs, params) if p.temperature == 0]
    sampled = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o, p in zip(outputs, params)
               if p.temperature != 0]  # fmt: skip
    return greedy_out, sampled


def _nll_per_run(model, requests, sampled) -> dict[tuple[int, int], torch.Tensor]:
    """`(config, seed) -> [n]` NLL of every generated token under the target at the config's temperature."""
    per_run: dict[tuple[int, int], list[torch.Tensor]] = {}
    with torch.no_grad():
        for (_, _, c, s), (prompt, completion) in zip(requests, sampled):
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
            logp = (logits / CONFIGS[c][0]).log_softmax(-1)
            per_run.setdefault((c, s), []).append(-logp.gather(-1, torch.tensor(completion)[:, None])[:, 0])
    return {key: torch.cat(values) for key, values in per_run.items()}


def test_plugin_sampling_nll_matches_plain_and_greedy_is_unchanged(target, random_folders, plain_greedy):
    """The plugin with a random drafter (most drafts rejected: most tokens are recovered samples) against plain
    vLLM, both on the same seeded requests. Bound: plain's own seed-to-seed spread of the per-run mean NLL (or the
    token-level standard error, whichever is larger), 4.5 sigma on the difference of the means over seeds."""
    from transformers import AutoModelForCausalLM

    requests = _sampled_requests()
    llm = make_llm(target)
    try:
        _, plain = _run(llm, requests, greedy_too=False)
    finally:
        close_llm(llm)
    llm = make_llm(target, {"method": "dflash", "model": str(random_folders / "retrace"), "num_speculative_tokens": 3})
    try:
        greedy_out, spec = _run(llm, requests, greedy_too=True)
    finally:
        close_llm(llm)
    assert greedy_out == plain_greedy, "greedy requests in a mixed batch differ from plain greedy"

    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    plain_nll, spec_nll = _nll_per_run(model, requests, plain), _nll_per_run(model, requests, spec)
    for c, config in enumerate(CONFIGS):
        runs = [plain_nll[(c, s)] for s in range(SEEDS)]
        plain_means = torch.stack([r.mean() for r in runs])
        spec_mean = torch.stack([spec_nll[(c, s)].mean() for s in range(SEEDS)]).mean()
        token_se = torch.cat(runs).std() / math.sqrt(sum(r.numel() for r in runs) / SEEDS)
        sigma = max(float(plain_means.std()), float(token_se)) * math.sqrt(2 / SEEDS)
        gap = abs(float(spec_mean - plain_means.mean()))
        assert gap < 4.5 * sigma, (
            f"T, top-p, top-k = {config}: NLL per token {float(spec_mean):.3f} with the plugin, "
            f"{float(plain_means.mean()):.3f} plain (seed means {plain_means.tolist()}), bound {4.5 * sigma:.3f}"
        )
