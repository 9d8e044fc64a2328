"""Kimi-K3 image input: the MoonViT-3d vision tower, the ``patchmergerv2`` projector and the image preprocessing
(``preprocessor_config.json`` → ``pixel_values`` + ``grid_thw``), one job per file."""
