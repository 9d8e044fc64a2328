"""GGUF (llama.cpp) loading for Kimi Linear and Kimi-K3: reader, arch tables, tokenizer, quant layouts."""
