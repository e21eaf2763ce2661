"""Tokenizers and chat templates, shared by the gateway, training and the default checkpoint: a
checkpoint's tokenizer (tokenizers or tiktoken) with its chat template (`tokenizer.py`,
`chat_template.py`), and the seeded default BPE of the random checkpoint (`default_tokenizer.py`)."""
