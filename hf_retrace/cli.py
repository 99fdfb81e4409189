"""`hf-retrace` console script:
`hf-retrace {train,generate-data,build-pool,draft-vocab,datastore,bench,analyze,publish} ...`; each subcommand owns its
own parser and is imported only when it runs (training needs the `train` extra)."""

import importlib
import sys


_SUBCOMMANDS = {
    "train": ("hf_retrace.scripts.train", "cli_main", "train a DFlash/ReTrace drafter from a recipe (--config)"),
    "generate-data": ("hf_retrace.scripts.generate_data", "cli_main", "regenerate training responses with the target"),
    "build-pool": ("hf_retrace.scripts.build_pool", "cli_main", "build the token pool and target-feature cache"),
    "bench": ("hf_retrace.bench.run", "main", "evaluate decoding methods on prompt sets (tau, tokens/s, lossless check)"),
    "draft-vocab": ("hf_retrace.scripts.draft_vocab", "cli_main", "re-rank a drafter's draft vocabulary on pools"),
    "datastore": ("hf_retrace.scripts.datastore", "cli_main", "attach pool responses to a drafter for datastore lookup"),
    "analyze": ("hf_retrace.bench.analyze", "main", "rejected-suffix statistics of a drafter (top-1/top-5 agreement)"),
    "publish": ("hf_retrace.hub.publish", "publish_main", "validate a drafter folder, render its card, upload to the Hub"),
}


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
        return 2
    module_name, func_name, _ = _SUBCOMMANDS[argv[0]]
    return getattr(importlib.import_module(module_name), func_name)(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
