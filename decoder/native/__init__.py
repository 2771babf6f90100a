"""A native (C, AVX2) forward pass for small Llama models on CPUs: see llama_step.c and llama.py."""
