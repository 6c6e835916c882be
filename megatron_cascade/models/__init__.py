"""Model families: what the project knows of each Hugging Face architecture, one folder each.

A family (``family.py``'s ``ModelFamily``) maps its ``config.json`` to a ``ModelConfig`` and back,
names its tensors on both sides and refuses what the Megatron model cannot reproduce; the conversion
engine (``convert/``) asks it through ``registry.py``. Adding a family (README, "Extending"): a folder
``models/<name>/`` with a ``ModelFamily`` subclass as ``FAMILY`` (a Llama-style one extends
``llama.family.LlamaFamily`` with its flags and MoE block, as ``mixtral/`` does), one line in
``registry.FAMILIES``, and the family in ``tests/convert/convert_fixtures.FAMILIES`` (the conversion
and layout-invariance tests). ``architectures/`` holds the Megatron-Core model classes the families
build (``gpt``, ``hybrid``), which the builder, the dry run, the converter and the doctor ask.
"""
