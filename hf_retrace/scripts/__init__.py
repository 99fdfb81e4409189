"""The training-side commands, TRL style (`trl/scripts/*`): each module has `make_parser()`, `main(...)` and
`cli_main(argv)`; `hf-retrace train|generate-data|build-pool` and the thin `training/*.py` entry points call them."""
