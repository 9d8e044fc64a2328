"""``kimi-mlx serve``: an OpenAI- and Anthropic-compatible HTTP server with a cross-request prefix cache and
continuous batching."""
