# /// script
# dependencies = ["hf-retrace[train,eval,assets]"]
# ///
"""Builds the drafter's training pool (token shards + the target's features), resumably.

`python training/build_pool.py ...` is `hf-retrace build-pool ...`; options and formats are documented in
`hf_retrace.scripts.build_pool` and `hf_retrace.data.pool`.
"""

from hf_retrace.scripts.build_pool import cli_main, main, make_parser


__all__ = ["cli_main", "main", "make_parser"]


if __name__ == "__main__":
    raise SystemExit(cli_main())
