"""The drafting policy shared with the transformers side: copies of `hf_retrace/models/` files that import numpy and
the standard library only (the settings and their checks, the candidate sources, prompt lookup, the datastore index
and its file). Never edit them here: edit the original and run `python utils/check_copies.py --fix`; the main suite's
`tests/test_check_copies.py` fails when a copy drifts."""
