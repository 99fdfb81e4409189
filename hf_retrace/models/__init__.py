"""The Hub files of the ReTrace drafter: configuration, model, candidate generator and its parts.

They import only torch, transformers, numpy and each other (relative imports), so `save_pretrained` can copy them
next to the weights and `trust_remote_code=True` loads them where hf_retrace is not installed. Import order (no
circles):

    datastore_file_retrace, draft_head_retrace, hook_retrace                      (no Hub imports)
    acceptance_retrace, cost_model_retrace, online_datastore_retrace              (no Hub imports)
    goodput_retrace <- acceptance_retrace, cost_model_retrace
    lookup_retrace <- datastore_file_retrace
    sources_retrace <- lookup_retrace, acceptance_retrace, goodput_retrace, online_datastore_retrace
    policy_settings_retrace <- sources_retrace
    speculation_retrace <- acceptance_retrace, cost_model_retrace, goodput_retrace, sources_retrace,
                           policy_settings_retrace
    speculation_state_retrace <- acceptance_retrace, cost_model_retrace, online_datastore_retrace
    decoding_retrace, configuration_retrace <- policy_settings_retrace
    generation_retrace <- sources_retrace, policy_settings_retrace, speculation_retrace, speculation_state_retrace,
                          decoding_retrace, draft_head_retrace
    drafter_files_retrace <- datastore_file_retrace, lookup_retrace, decoding_retrace
    modeling_retrace <- all of them; importing `hook_retrace` installs the generate hook

The drafting policy (`datastore_file_retrace`, `lookup_retrace`, `sources_retrace`, `policy_settings_retrace`,
`speculation_retrace` and the cost-aware core `acceptance_retrace`, `cost_model_retrace`, `goodput_retrace`,
`online_datastore_retrace`) needs numpy and the standard library only: the vLLM plugin runs byte-identical copies of
those files (`integrations/vllm/hf_retrace_vllm/shared/`, kept identical by `utils/check_copies.py`).
"""
