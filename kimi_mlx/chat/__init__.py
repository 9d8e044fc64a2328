"""Chat: rendering conversations in the models' own formats (``format``, ``format_k3``), the tokenizer ready for chat
(``tokenizer``: its format, default system prompt and ``apply_chat_template``), parsing replies back into
reasoning / content / tool calls (``parser``), and a multi-turn session over one model cache (``session``)."""
