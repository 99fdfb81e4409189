"""Share a ReTrace drafter as a Hub folder and load it back the way a Hub user does (works offline).

    python examples/03_load_from_hub.py                       # demo drafter for the default target, saved to a tmp dir
    python examples/03_load_from_hub.py --drafter ORG/NAME    # a published drafter (repo id or folder) for that target

1. `save_for_hub` writes weights, config.json with `auto_map`, the three Hub code files, `custom_generate/` and the card.
2. `AutoModel.from_pretrained(..., trust_remote_code=True)` loads it; it runs as `assistant_model=`.
3. `custom_generate=<repo or folder>` runs ReTrace with no drafter argument: the recipe loads the drafter it ships with.
Every route must equal the target's own greedy output. Then publish with
`hf-retrace publish FOLDER --repo-id ORG/NAME --dry-run` (drop `--dry-run` to upload).
"""

import argparse
import tempfile

import torch
from transformers import AutoModel

from hf_retrace import ReTraceDrafterModel
from hf_retrace.data.assets import DEFAULT_TARGET_NAME, load_default_target
from hf_retrace.hub.publish import save_for_hub


def main(drafter_source: str | None, max_new_tokens: int) -> None:
    target, tokenizer = load_default_target(dtype=torch.float32)  # fp32: greedy comparisons are exact
    inputs = tokenizer("The three primary colours are", return_tensors="pt")
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if drafter_source is None:  # an untrained demo drafter: lossless, but tau stays near 1
        drafter_source = tempfile.mkdtemp(prefix="retrace-drafter-")
        drafter = ReTraceDrafterModel.from_target(target, num_hidden_layers=1, block_size=8)
        save_for_hub(drafter, drafter_source, base_model=f"HuggingFaceTB/{DEFAULT_TARGET_NAME}")
        print(f"saved Hub folder: {drafter_source}")

    reference = target.generate(**inputs, **greedy)
    drafter = AutoModel.from_pretrained(drafter_source, trust_remote_code=True, dtype=target.dtype)
    assisted = target.generate(**inputs, assistant_model=drafter, **greedy)
    recipe = target.generate(**inputs, custom_generate=drafter_source, trust_remote_code=True, **greedy)

    print(tokenizer.decode(reference[0], skip_special_tokens=True))
    print(f"assistant_model == greedy: {torch.equal(assisted, reference)}; "
          f"custom_generate == greedy: {torch.equal(recipe, reference)}; "
          f"tau = {drafter.last_generation_stats.tau:.2f}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", help="repo id or folder of a ReTrace drafter for the default target")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    main(args.drafter, args.max_new_tokens)
