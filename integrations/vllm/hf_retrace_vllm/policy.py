"""The drafting policy of an exported hf-retrace folder (the `hf_retrace` block of its `config.json`,
`docs/formats.md`): which source proposes a cycle's tokens (the registered candidate sources in priority order,
then the drafter) and how many. vLLM-free, so the main suite imports it to check both engines propose alike.

The settings, their checks and the sources are the transformers side's own code (`shared/`, copies kept identical by
`utils/check_copies.py`); this module only reads the block and names the sources as the proposer's counters do.
"""

from dataclasses import dataclass

import numpy as np

from .datastore import FolderDatastore
from .shared.policy_settings_retrace import RETRACE_MODES, ReTraceDecodingSettings, settings_from_export
from .shared.sources_retrace import CandidateSource, candidate_sources, propose_from_sources


DRAFTER = "draft"  # the source name of a cycle no candidate source proposes
STATS_NAMES = {"prompt_lookup": "lookup"}  # the proposer's counters (`stats.py`) call prompt lookup `lookup`
_BLOCK_KEYS = ("anchor_broadcast", "retrace_mode", "datastore_file")  # beside the settings; `source_commit` is a note


@dataclass(frozen=True)
class DraftPolicy:
    """The `hf_retrace` block of an exported folder, checked by the shared settings checks.

    Attributes:
        block_size (`int`): `B`, the drafter's trained block (anchor + `B-1` mask slots); the drafter always runs it.
        anchor_broadcast (`bool`), retrace_mode (`str`): the drafter's anchor term and ReTrace conditioning mode.
        datastore_file (`str` or `None`): the folder's datastore file, when it has one.
        settings ([`ReTraceDecodingSettings`]): the decoding settings (`num_assistant_tokens`, the confidence stop,
            each registered source's setting and options), as the transformers side resolves them.
    """

    block_size: int
    anchor_broadcast: bool
    retrace_mode: str
    datastore_file: str | None
    settings: ReTraceDecodingSettings

    @property
    def num_assistant_tokens(self) -> int:
        """`k`, drafts of a block that are verified (`1 <= k <= B-1`)."""
        return self.settings.num_assistant_tokens

    @property
    def confidence_threshold(self) -> float | None:
        """Verify only the leading drafts whose top-1 draft probability is at least this (`None`: no stop)."""
        return self.settings.assistant_confidence_threshold

    @classmethod
    def from_hf_config(cls, hf_config) -> "DraftPolicy":
        """Reads and checks `hf_config.hf_retrace` (a dict holding every key the export writes); raises
        `ValueError` saying what is wrong."""
        block = getattr(hf_config, "hf_retrace", None)
        if not isinstance(block, dict):
            raise ValueError(
                "this drafter folder has no `hf_retrace` block in its config.json; write it with "
                "`hf-retrace export --format vllm --drafter DIR --output OUT`"
            )
        block_size = int(getattr(hf_config, "block_size", 0) or 0)
        if block_size < 2:
            raise ValueError(f"config.json needs block_size >= 2 (the drafter's trained block), got {block_size}")
        missing = [key for key in _BLOCK_KEYS if key not in block]
        if missing:
            raise ValueError(f"the hf_retrace block lacks {missing}; export the folder again with "
                             "`hf-retrace export --format vllm`")  # fmt: skip
        if block["retrace_mode"] not in RETRACE_MODES:
            raise ValueError(f"hf_retrace.retrace_mode must be one of {RETRACE_MODES}, got {block['retrace_mode']!r}")
        available = frozenset({"datastore"} if block["datastore_file"] else ())
        try:
            settings = settings_from_export(block, block_size, available)
        except ValueError as err:
            raise ValueError(f"hf_retrace block: {err}") from err
        return cls(block_size, bool(block["anchor_broadcast"]), block["retrace_mode"], block["datastore_file"],
                   settings)  # fmt: skip


def check_token_budget(max_num_batched_tokens: int, max_num_seqs: int, block_size: int) -> None:
    """Raises `ValueError` when one drafter forward could need more slots than the engine's token budget sizes its
    buffers for: the drafter runs its whole block, `block_size` slots, for every running request (up to
    `max_num_seqs`) in one forward. vLLM's CPU defaults (4096 tokens, 256 sequences; 2048 and 128 for the server) fit
    a 16-slot block exactly."""
    if max_num_batched_tokens < max_num_seqs * block_size:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens} is less than max_num_seqs x block_size = "
            f"{max_num_seqs} x {block_size} = {max_num_seqs * block_size}: the hf-retrace drafter runs a block of "
            f"{block_size} slots per request in one forward. Raise max_num_batched_tokens to at least "
            f"{max_num_seqs * block_size}, or lower max_num_seqs to at most {max_num_batched_tokens // block_size}"
        )


def policy_sources(policy: DraftPolicy, folder, vocab_size: int) -> list[CandidateSource]:
    """The candidate sources `policy` turns on, in the order a cycle asks them (the shared registry's), built over the
    exported `folder` (its datastore file is read and indexed here, once)."""
    return candidate_sources(policy.settings, FolderDatastore(folder, policy.datastore_file, vocab_size))


def lookup(sources: list[CandidateSource], tokens: np.ndarray, max_tokens: int) -> tuple[list[int] | None, str]:
    """What a cycle proposes before the drafter: `(tokens, source name)` of the first of `sources` that proposes, or
    `(None, "draft")` when none does and the drafter drafts.

    Args:
        sources (`list[CandidateSource]`): from [`policy_sources`].
        tokens (`np.ndarray` of shape `(T,)`): the committed tokens, prompt and output.
        max_tokens (`int`): most tokens the cycle may propose, at least 1.
    """
    source, proposal = propose_from_sources(sources, tokens, max_tokens)
    if source is None:
        return None, DRAFTER
    return proposal, STATS_NAMES.get(source.name, source.name)


__all__ = ["DRAFTER", "DraftPolicy", "RETRACE_MODES", "check_token_budget", "lookup", "policy_sources"]
