"""A model's weights in and out: a run's checkpoint or GPT-2's weights for use or to start a run from (loading),
Hugging Face's GPT-2 layout both ways (hf, and its tokenizer files: hf_tokenizer), and a GGUF for llama.cpp (gguf)."""
