"""Chat: rendering conversations in the models' own formats (``format``, ``format_k3``), the tokenizer ready for chat
(``tokenizer``: its format, default system prompt and ``apply_chat_template``), parsing replies back into
reasoning / content / tool calls (``parser``), a multi-turn session over one model cache (``session``), and images in
messages (``images``: the image part, preparing a conversation's images, K3's media sequence; ``saved_images``: a
session's images in its saved file)."""
