"""Chat: rendering conversations in the models' own formats (``format``, ``format_k3``), parsing replies back into
reasoning / content / tool calls (``parser``), and a multi-turn session over one model cache (``session``)."""
