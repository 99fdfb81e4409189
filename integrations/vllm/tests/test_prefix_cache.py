"""The prefix cache with an hf-retrace drafter reuses what vLLM without speculation reuses (patches.py, hook point
6), and the output stays vLLM's greedy output."""

from vllm import SamplingParams

from conftest import close_llm, make_llm


MAX_TOKENS = 24


def _prompts(llm) -> list[str]:
    """Two prompts that share a prefix of two cache blocks and a half (so a hit covers two whole blocks)."""
    tokenizer = llm.get_tokenizer()
    block = llm.llm_engine.vllm_config.cache_config.block_size
    line = "Each line of this shared preamble repeats the same words about caching prompts.\n"
    shared = line * (5 * block // (2 * len(tokenizer.encode(line))) + 1)
    return [shared + "Now name three planets:", shared + "Now count to five:"]


def _cached_and_outputs(llm) -> tuple[list[int], list[list[int]]]:
    """Each prompt run after the other: the tokens the second one read from the prefix cache, and the outputs."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    cached, outputs = [], []
    for prompt in _prompts(llm):
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        cached.append(output.num_cached_tokens)
        outputs.append(list(output.outputs[0].token_ids))
    return cached, outputs


def test_prefix_hits_match_plain_vllm(target, exports):
    llm = make_llm(target)
    try:
        block = llm.llm_engine.vllm_config.cache_config.block_size
        plain_cached, plain_outputs = _cached_and_outputs(llm)
    finally:
        close_llm(llm)
    assert plain_cached[1] >= 2 * block, plain_cached  # the shared prefix's two whole blocks
    llm = make_llm(target, {"method": "dflash", "model": str(exports("smollm2-135m-retrace")),
                            "num_speculative_tokens": 3})  # fmt: skip
    try:
        assert not llm.llm_engine.vllm_config.speculative_config.use_eagle_block_drop()
        cached, outputs = _cached_and_outputs(llm)
    finally:
        close_llm(llm)
    assert cached == plain_cached  # vLLM's EAGLE block drop would have left one block out
    assert outputs == plain_outputs
