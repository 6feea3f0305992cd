"""A model's weights in and out: a run's checkpoint or GPT-2's weights for use (loading), init_from for a new
run (finetune), Hugging Face's GPT-2 layout both ways (hf), and a GGUF for llama.cpp (gguf)."""
