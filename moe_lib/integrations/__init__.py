"""moe_lib inside other frameworks' models. :mod:`.hf`: Hugging Face transformers (imports transformers)."""
