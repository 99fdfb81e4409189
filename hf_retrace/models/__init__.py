"""The Hub files of the ReTrace drafter: configuration, model, candidate generator.

They import only torch, transformers and each other (relative imports), so `save_pretrained` can copy them next to
the weights and `trust_remote_code=True` loads them where hf_retrace is not installed. Import order:
`configuration_retrace` <- `generation_retrace` <- `modeling_retrace`; importing `generation_retrace` installs the
generate hook.
"""
