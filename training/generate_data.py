# /// script
# dependencies = ["hf-retrace[train,eval,assets]"]
# ///
"""Regenerates the drafter's training data: the target's own responses to a mix of prompt sets.

`python training/generate_data.py ...` is `hf-retrace generate-data ...`; options and the resumable chunking are
documented in `hf_retrace.scripts.generate_data`.
"""

from hf_retrace.scripts.generate_data import cli_main, main, make_parser


__all__ = ["cli_main", "main", "make_parser"]


if __name__ == "__main__":
    raise SystemExit(cli_main())
