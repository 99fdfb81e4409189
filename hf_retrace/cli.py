"""`hf-retrace` console script:
`hf-retrace {train,generate-data,build-pool,draft-vocab,datastore,bench,replay,analyze,publish,export} ...`; each
subcommand owns its own parser and is imported only when it runs (training needs the `train` extra).

A user's mistake (a missing file, an invalid value) is one line on stderr and exit status 2, like argparse's own
errors: subcommands raise [`UsageError`] for it, from the validation they do before the long work starts. Every other
exception is a bug and keeps its traceback.
"""

import functools
import importlib
import os
import sys
from collections.abc import Callable


_SUBCOMMANDS = {
    "train": ("hf_retrace.scripts.train", "cli_main", "train a DFlash/ReTrace drafter from a recipe (--config)"),
    "generate-data": ("hf_retrace.scripts.generate_data", "cli_main", "regenerate training responses with the target"),
    "build-pool": ("hf_retrace.scripts.build_pool", "cli_main", "build the token pool and target-feature cache"),
    "bench": ("hf_retrace.bench.run", "main", "evaluate decoding methods on prompt sets (tau, tokens/s, lossless)"),
    "draft-vocab": ("hf_retrace.scripts.draft_vocab", "cli_main", "re-rank a drafter's draft vocabulary on pools"),
    "datastore": ("hf_retrace.scripts.datastore", "cli_main", "attach pool responses to a drafter (datastore lookup)"),
    "replay": ("hf_retrace.scripts.replay", "cli_main", "score drafters offline: the bench's greedy tau in a minute"),
    "analyze": ("hf_retrace.bench.analyze", "main", "rejected-suffix statistics of a drafter (top-1/top-5 agreement)"),
    "publish": ("hf_retrace.hub.publish", "publish_main", "validate a drafter folder, render its card, upload it"),
    "export": ("hf_retrace.scripts.export", "cli_main", "write a drafter folder for vLLM (--format vllm)"),
}
USAGE_ERROR_STATUS = 2  # argparse's


class UsageError(Exception):
    """A mistake in what the user passed (a missing file, an invalid value); the message says what and how to fix it.
    `hf-retrace` prints it as one line and exits with status 2, without a traceback."""


def exits_on_usage_error(prog: str) -> Callable:
    """Decorates a subcommand's `main(argv)`: a [`UsageError`] becomes `"{prog}: error: ..."` on stderr and status 2,
    so `python training/train.py` reports it as `hf-retrace train` does. Other exceptions pass through."""

    def decorate(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
        @functools.wraps(main)
        def wrapper(argv: list[str] | None = None) -> int:
            try:
                return main(argv) or 0
            except UsageError as error:
                print(f"{prog}: error: {error}", file=sys.stderr)
                return USAGE_ERROR_STATUS

        return wrapper

    return decorate


def looks_like_a_path(value: str) -> bool:
    """Whether `value` names a local file or folder rather than a Hub repo id (`NAME` or `OWNER/NAME`): absolute,
    relative with `./`, `../` or `~`, more than one `/`, or a data-file suffix."""
    return (
        os.path.isabs(value)
        or value.startswith(("./", "../", "~"))
        or value.count("/") > 1
        or value.endswith((".json", ".jsonl", ".yaml", ".yml"))
    )


def check_exists(value: str | None, option: str, what: str = "folder", repo_id_ok: bool = True) -> None:
    """Raises [`UsageError`] when `value` names a local path that does not exist: any `value` with
    `repo_id_ok=False`, else only one that [`looks_like_a_path`] (a bare `owner/name` may be a Hub repo)."""
    if not value or os.path.exists(os.path.expanduser(value)) or (repo_id_ok and not looks_like_a_path(value)):
        return
    fix = f"an existing {what}" + (" or a Hub repo id 'owner/name'" if repo_id_ok else "")
    raise UsageError(f"{option} {value!r}: no such {what}; pass {fix}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _SUBCOMMANDS:
        lines = [f"  {name:<14} {help_}" for name, (_, _, help_) in _SUBCOMMANDS.items()]
        usage = "usage: hf-retrace {" + ",".join(_SUBCOMMANDS) + "} ...\n\n" + "\n".join(lines)
        if argv[:1] in (["-h"], ["--help"]):
            print(usage)
            return 0
        problem = f"unknown command {argv[0]!r}" if argv else "missing command"
        print(f"hf-retrace: error: {problem}\n{usage}", file=sys.stderr)
        return USAGE_ERROR_STATUS
    module_name, func_name, _ = _SUBCOMMANDS[argv[0]]
    subcommand = getattr(importlib.import_module(module_name), func_name)
    return exits_on_usage_error(f"hf-retrace {argv[0]}")(subcommand)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
