"""The model card of a ReTrace drafter repo: evaluation JSON, its results table, rendering and metadata checks.

[`render_model_card`] fills `hf_retrace/hub/templates/model_card.md`; [`check_card_metadata`] checks its metadata
offline.

Evaluation JSON schema (input of the card's table; `hf-retrace bench` output is expected to follow it):

    {
      "results": [                       # required: one row per (method, prompt set)
        {"method": "retrace", "prompt_set": "gsm_symbolic", "tau": 3.41, "tokens_per_s": 61.2, "speedup": 2.27},
        ...
      ],
      "target": "...", "dtype": "...",   # optional top-level scalars: shown as a "Setup" line above the table
    }

Row keys `method`, `prompt_set`, `tau`, `tokens_per_s`, `speedup` become the columns; a missing or null one renders
as "–"; other row keys are ignored.
"""

import json
import math
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from ..models.decoding_retrace import ReTraceDecodingSettings
from .validation import is_repo_id


CARD_TAGS = ("speculative-decoding", "dflash", "retrace")
FIXED_METADATA = {"library_name": "transformers", "pipeline_tag": "text-generation"}
EVAL_COLUMNS = (  # (row key, column title, number format)
    ("method", "Method", "{}"),
    ("prompt_set", "Prompt set", "{}"),
    ("tau", "tau", "{:.2f}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("speedup", "Speedup", "{:.2f}×"),
)
DEFAULT_TEMPLATE_PATH = Path(__file__).resolve().parent / "templates" / "model_card.md"


def load_eval_results(path) -> dict:
    """Reads and checks an evaluation JSON (schema in the module docstring)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"Cannot read evaluation JSON {path}: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        example = '{"results": [{"method": "retrace", "prompt_set": "gsm", "tau": 3.4, "speedup": 2.1}]}'
        raise ValueError(f'Evaluation JSON {path} needs a top-level "results" list of rows, e.g. {example}')
    if not all(isinstance(row, dict) for row in data["results"]):
        raise ValueError(f'Every entry of "results" in {path} must be an object (a table row).')
    return data


def format_eval_cell(row: dict, key: str, fmt: str) -> str:
    """One table cell: formatted number, plain text, or "–" when missing/null/NaN."""
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value)
    return str(value).replace("|", "\\|")


def eval_table(eval_data: dict) -> str:
    """Markdown table of `eval_data["results"]`, one row per entry, columns `EVAL_COLUMNS`."""
    lines = ["| " + " | ".join(title for _, title, _ in EVAL_COLUMNS) + " |", "|---" * len(EVAL_COLUMNS) + "|"]
    for row in eval_data["results"]:
        lines.append("| " + " | ".join(format_eval_cell(row, key, fmt) for key, _, fmt in EVAL_COLUMNS) + " |")
    return "\n".join(lines)


def render_model_card(
    config, decoding: ReTraceDecodingSettings, *, repo_id: str, datastore_size=None, base_model=None,
    license="apache-2.0", datasets=None, eval_data=None, num_parameters=None, template_path=None, tags=None,
) -> ModelCard:  # fmt: skip
    """Renders `hf_retrace/hub/templates/model_card.md` (or `template_path`) for a drafter published as `repo_id`.

    Args:
        config ([`ReTraceDrafterConfig`]): the network (`drafter.config`).
        decoding ([`ReTraceDecodingSettings`]): the decoding settings (`drafter.decoding_settings()`): config.json
            no longer carries them, so a card rendered from the config alone would state the defaults.
        datastore_size (`int`, *optional*): tokens in the drafter's datastore (`drafter.datastore_size`).

    Metadata: `library_name: transformers`, `pipeline_tag: text-generation`, `base_model` (the target), `license`,
    `tags` [`CARD_TAGS`] then `tags` (e.g. the trainer's), `datasets`. The usage snippet loads `repo_id` and
    `base_model`.
    """
    if not isinstance(decoding, ReTraceDecodingSettings):
        raise TypeError(
            f"decoding must be the drafter's ReTraceDecodingSettings (`drafter.decoding_settings()`), got "
            f"{type(decoding).__name__}"
        )
    template = Path(template_path or DEFAULT_TEMPLATE_PATH)
    if not template.is_file():
        raise FileNotFoundError(
            f"Model card template {template} not found; pass template_path= (it ships in the source checkout "
            "under model_cards/)."
        )
    data = ModelCardData(
        **FIXED_METADATA, base_model=base_model, license=license, datasets=datasets or None,
        tags=list(dict.fromkeys([*CARD_TAGS, *(tags or [])])),
    )  # fmt: skip
    setup = {k: v for k, v in (eval_data or {}).items() if k != "results" and isinstance(v, (str, int, float, bool))}
    return ModelCard.from_template(
        data,
        template_path=str(template),
        config=config,
        decoding=decoding,
        datastore_size=datastore_size,
        repo_id=repo_id,
        model_name=repo_id.rstrip("/").split("/")[-1],
        base_model=base_model,
        target_id=base_model or "TARGET_MODEL_ID",
        num_parameters=f"{num_parameters:,}" if num_parameters else "–",
        eval_table=eval_table(eval_data) if eval_data else None,
        eval_setup="Setup: " + ", ".join(f"{k} = `{v}`" for k, v in setup.items()) if setup else None,
    )


def check_card_metadata(card: ModelCard) -> list[str]:
    """Offline metadata checks (the Hub's own YAML validation needs the network); returns the problems found."""
    data = card.data
    problems = [f"{k} must be {v!r}, got {data.get(k)!r}" for k, v in FIXED_METADATA.items() if data.get(k) != v]
    if not data.license:
        problems.append("license is missing; pass --license (e.g. apache-2.0)")
    missing_tags = [t for t in CARD_TAGS if t not in (data.tags or [])]
    if missing_tags:
        problems.append(f"tags {missing_tags} are missing")
    if data.base_model is not None and not is_repo_id(data.base_model):
        problems.append(f"base_model must be a Hub model id such as 'Qwen/Qwen3-8B', got {data.base_model!r}")
    return problems


__all__ = [
    "CARD_TAGS",
    "EVAL_COLUMNS",
    "FIXED_METADATA",
    "check_card_metadata",
    "eval_table",
    "format_eval_cell",
    "load_eval_results",
    "render_model_card",
]
