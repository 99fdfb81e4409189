"""The Hub files of the ReTrace drafter: configuration, model, candidate generator and its parts.

They import only torch, transformers and each other (relative imports), so `save_pretrained` can copy them next to
the weights and `trust_remote_code=True` loads them where hf_retrace is not installed. Import order (no circles):

    decoding_retrace, datastore_file_retrace, draft_head_retrace, hook_retrace   (no Hub imports)
    configuration_retrace <- decoding_retrace
    datastore_retrace <- datastore_file_retrace
    candidates_retrace <- datastore_retrace, decoding_retrace
    generation_retrace <- candidates_retrace, decoding_retrace, draft_head_retrace
    drafter_files_retrace <- datastore_file_retrace, datastore_retrace, decoding_retrace
    modeling_retrace <- all of them; importing `hook_retrace` installs the generate hook
"""
