"""The developers' checks: they measure or verify the repo itself, not a user's run. From the repo root:

    python -m dev.gpu_check --dry-run

    gpu_check      the GPU path end to end on a CUDA machine (bf16, compile, DDP, resume, RNG, sample)
    vs_nanogpt     our train.py against nanoGPT's own, alternating rounds at its CPU recipe
    bench_sample   sample.py's tokens/s with and without the KV cache, and that both give the same text
    bench_prepare  corpus preparation's MB/s (.jsonl against .parquet) and one large .txt's peak memory
    bpe_trainers   seconds to train a BPE with rustbpe against Hugging Face tokenizers, and whether each repeats

They run like the user's tools in scripts/ (`python -m`, the reasons are in scripts/__init__.py).
"""
