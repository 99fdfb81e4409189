"""Sharing drafters on the Hugging Face Hub: `hf-retrace publish` and `save_for_hub` (`publish`), folder checks
(`validation`), the model card (`model_card`, `templates/`), and the `custom_generate` recipe template."""
