"""Kimi Linear and Kimi-K3 on MLX."""
