"""GGML block tensors (the GGUF file's bytes) computed exactly: formats and tables, dequantization, matmuls."""

from .dequant import dequantize
from .formats import FORMATS, IQ1_DELTA, BlockFormat, get_format, mx_tables, row_bytes, tables
from .matmul import DEQUANT_CHUNK_BYTES, ggml_expert_matmul, ggml_gather_matmul, ggml_matmul

__all__ = [
    "DEQUANT_CHUNK_BYTES",
    "FORMATS",
    "IQ1_DELTA",
    "BlockFormat",
    "dequantize",
    "get_format",
    "ggml_expert_matmul",
    "ggml_gather_matmul",
    "ggml_matmul",
    "mx_tables",
    "row_bytes",
    "tables",
]
