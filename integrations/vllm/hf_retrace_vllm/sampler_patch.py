"""Exact speculative sampling on vLLM 0.32.0's CPU path (every speculative method: the plugin, `ngram`, `suffix`).

What is wrong without it: vLLM's rejection sampler is written as Triton kernels, which its CPU build replaces with
C++ ops (`vllm/platforms/cpu.py` -> `vllm/utils/cpu_triton_utils.py`). The replacement for `expand_kernel`,
`_expand_kernel_impl`, hands the C++ op `_ensure_int64(output)`: for any output that is not int64 that is a new
tensor, so the op writes into a copy that is thrown away, and the caller's output stays `new_empty`, i.e.
uninitialised memory. `apply_sampling_constraints` expands the per-request temperature (float32), top-k (int32) and
top-p (float32) to the draft positions through it, so the target distribution the drafts are verified against is
divided by garbage temperatures (tiny, huge or negative) and cut by garbage top-k / top-p. Greedy requests never read
it (their check is an argmax), which is why greedy output stays exact while sampled text is corrupted.

The patch (CPU tensors only; other devices keep vLLM's functions):
1. `expand_batch_to_tokens`: the same expansion in plain torch, in the input's dtype.
2. `rejection_sample`: the standard rule in plain torch, so the CPU path no longer depends on the C++ ops either:
   accept draft `x` with probability `min(1, p(x) / q(x))` (`q` one-hot when the proposer gives no probabilities:
   the plugin's greedy drafts, `ngram`, `suffix`); at the first rejection sample from the normalised residual
   `max(0, p - q)`; when every draft is accepted, the bonus token vLLM's own sampler drew from `p`. `p` is the target
   distribution after vLLM's temperature, top-k and top-p (`apply_sampling_constraints`, with the expansion fixed),
   the same processing its sampler applies without speculation. Random numbers come from the same calls and the same
   per-request generators as vLLM's (`generate_uniform_probs`, one exponential draw a request for the recovered
   token), so a request's `seed` still fixes its output. Greedy requests keep argmax verification, and a batch of
   greedy requests only still goes through vLLM's own function, untouched.
3. `RejectionSampler.forward`, for a step that verifies no draft at all (no request has one: the plugin's plain steps,
   or any method's step with nothing proposed): vLLM's own sampler on the step's logits, the very call vLLM makes
   without a speculative config. With a speculative config every step goes through the rejection sampler, which for
   zero drafts still samples every request's bonus token with full-vocabulary logits kept for logprobs and runs its
   draft stages on empty tensors: ~1.5 ms a step of 32 requests on two cores, 1% of a decode step. Each request's
   token is drawn from the same processed target distribution with the same generator calls. Steps that ask for
   logprobs keep vLLM's path (it lays them out per draft position).
"""

import functools

import torch

from .contract import MARK, SAMPLER_MODULE


def install() -> None:
    """Replaces `expand_batch_to_tokens` and `rejection_sample` in vLLM's rejection sampler module, and
    `RejectionSampler.forward` (once). `RejectionSampler.forward` and `apply_sampling_constraints` look the first two
    up as module globals at call time."""
    import importlib

    module = importlib.import_module(SAMPLER_MODULE)
    for name, wrap in (("expand_batch_to_tokens", _wrap_expand), ("rejection_sample", _wrap_rejection_sample)):
        original = getattr(module, name)
        if not getattr(original, MARK, False):
            patched = wrap(original)
            setattr(patched, MARK, True)
            setattr(module, name, patched)
    sampler_class = module.RejectionSampler
    if not getattr(sampler_class.forward, MARK, False):
        patched = _wrap_forward(sampler_class.forward)
        setattr(patched, MARK, True)
        sampler_class.forward = patched


def verifies_nothing(metadata, logits: torch.Tensor, sampling_metadata) -> bool:
    """Whether a step's rejection sampling reduces to plain sampling (module docstring, 3.): no request has a draft,
    so `logits` `[batch, V]` holds one row a request, in order (`bonus_logits_indices` is `0 .. batch-1`), and no
    logprobs are asked for. CPU tensors only."""
    return (
        logits.device.type == "cpu" and metadata.max_spec_len == 0
        and logits.shape[0] == metadata.bonus_logits_indices.shape[0]
        and sampling_metadata.max_num_logprobs is None and not sampling_metadata.logprob_token_ids
    )  # fmt: skip


def _wrap_forward(original):
    @functools.wraps(original)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if verifies_nothing(metadata, logits, sampling_metadata):
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        return original(self, metadata, draft_probs, logits, sampling_metadata)

    return forward


def expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0, replace_to=0
) -> torch.Tensor:
    """Repeats request `i`'s value once per draft of request `i`, with `replace_from` read as `replace_to`.

    Args:
        x (`torch.Tensor` of shape `[batch]`): one value a request (temperature, top-k, top-p), any dtype.
        cu_num_tokens (`torch.Tensor` of shape `[batch]`): cumulative drafts per request.
        num_tokens (`int`): total drafts, `cu_num_tokens[-1]`.

    Returns:
        `torch.Tensor` of shape `[num_tokens]`, dtype of `x`.
    """
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = x.masked_fill(x == replace_from, replace_to)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def _wrap_expand(original):
    @functools.wraps(original)
    def patched(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.device.type != "cpu":
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        return expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)

    return patched


def _wrap_rejection_sample(original):
    @functools.wraps(original)
    def patched(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                bonus_token_ids, sampling_metadata, synthetic_mode=False, synthetic_conditional_rates=None,
                use_fp64_gumbel=False):  # fmt: skip
        if target_logits.device.type != "cpu" or synthetic_mode or sampling_metadata.all_greedy:
            return original(
                draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                bonus_token_ids, sampling_metadata, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel,
            )  # fmt: skip
        return rejection_sample(
            draft_token_ids, num_draft_tokens, max_spec_len, draft_probs, target_logits, bonus_token_ids,
            sampling_metadata, use_fp64_gumbel,
        )  # fmt: skip

    return patched


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    sampling_metadata,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:
    """Verifies every request's drafts at once (module docstring, 2.).

    Args:
        draft_token_ids (`torch.Tensor` of shape `[T]`): drafts of all requests, concatenated; `-1` is rejected.
        num_draft_tokens (`list[int]`): drafts per request (`batch` entries, zeros allowed).
        max_spec_len (`int`): most drafts of a request.
        draft_probs (`torch.Tensor` of shape `[T, V]`, *optional*): the proposer's `q`; `None` means one-hot.
        target_logits (`torch.Tensor` of shape `[T, V]`): target logits after temperature, top-k and top-p.
        bonus_token_ids (`torch.Tensor` of shape `[batch, 1]`): vLLM's sample from the target after the last draft.
        sampling_metadata (`SamplingMetadata`): `temperature` `[batch]` (0 for greedy), `generators` by batch row.

    Returns:
        `torch.Tensor` of shape `[batch, max_spec_len + 1]`, int32: accepted drafts, then the recovered token (first
        rejection) or the bonus token (all accepted), then `-1`.
    """
    from vllm.v1.sample import rejection_sampler as vllm_rs

    batch, num_tokens, device = len(num_draft_tokens), draft_token_ids.shape[0], target_logits.device
    counts = torch.tensor(num_draft_tokens, dtype=torch.long, device=device)
    req = torch.repeat_interleave(torch.arange(batch, device=device), counts, output_size=num_tokens)  # [T]
    pos = torch.arange(num_tokens, device=device) - (torch.cumsum(counts, 0) - counts)[req]  # [T]
    drafts = draft_token_ids.long()
    valid = drafts >= 0
    safe = drafts.clamp(min=0).unsqueeze(-1)  # [T, 1]
    greedy = sampling_metadata.temperature.to(device) == vllm_rs.GREEDY_TEMPERATURE  # [batch]

    # the same random draws as vLLM's sampler, in the same order: uniforms, then one exponential vector a request
    uniform = vllm_rs.generate_uniform_probs(num_tokens, num_draft_tokens, sampling_metadata.generators, device)
    noise = torch.empty((batch, target_logits.shape[-1]), dtype=torch.float64 if use_fp64_gumbel else torch.float32,
                        device=device).exponential_()  # fmt: skip
    for i, generator in sampling_metadata.generators.items():
        if num_draft_tokens[i] > 0:
            noise[i].exponential_(generator=generator)

    p = target_logits.softmax(dim=-1, dtype=torch.float32)  # [T, V]
    p_x = p.gather(-1, safe).squeeze(-1).double()
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
        residual = p.scatter(-1, safe, 0.0)  # max(0, p - onehot(x))
    else:
        q_x = draft_probs.gather(-1, safe).squeeze(-1).double()
        residual = (p - draft_probs.float()).clamp_(min=0.0)
    accept_random = valid & (q_x > 0) & (p_x >= uniform * q_x)  # u < p/q, without dividing by q
    # exponential race: argmax residual / E is a sample from residual / sum(residual)
    recovered = (residual / noise[req]).argmax(dim=-1)
    empty = residual.sum(-1) <= 0  # p == q: a rejection has probability 0 (only rounding gets here); keep p's mode
    recovered = torch.where(empty, p.argmax(-1), recovered)
    argmax = target_logits.argmax(dim=-1)
    accept = torch.where(greedy[req], drafts == argmax, accept_random)
    replacement = torch.where(greedy[req], argmax, recovered)
    return _assemble(accept, replacement, drafts, req, pos, counts, max_spec_len, bonus_token_ids)


def _assemble(accept, replacement, drafts, req, pos, counts, max_spec_len, bonus_token_ids) -> torch.Tensor:
    """Lays the per-draft decisions `[T]` out as vLLM's `[batch, max_spec_len + 1]` output (`rejection_sample`)."""
    batch = counts.shape[0]
    shape = (batch, max_spec_len + 1)
    accepted = torch.zeros(shape, dtype=torch.long, device=drafts.device).index_put_((req, pos), accept.long())
    draft_grid = torch.zeros(shape, dtype=torch.long, device=drafts.device).index_put_((req, pos), drafts)
    repl_grid = torch.zeros(shape, dtype=torch.long, device=drafts.device).index_put_((req, pos), replacement)
    num_accepted = accepted.cumprod(dim=1).sum(dim=1, keepdim=True)  # [batch, 1]: leading accepted drafts
    cols = torch.arange(max_spec_len + 1, device=drafts.device).unsqueeze(0)
    counts = counts.unsqueeze(1)
    out = torch.where(cols < num_accepted, draft_grid, -1)
    out = torch.where((cols == num_accepted) & (num_accepted < counts), repl_grid, out)
    out = torch.where((cols == counts) & (num_accepted == counts), bonus_token_ids.long().view(batch, 1), out)
    return out.to(torch.int32)
