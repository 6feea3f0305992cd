"""The developers' checks: they measure or verify the repo itself, not a user's run. From the repo root:

    python -m dev.gpu_check --dry-run

    gpu_check   the GPU path end to end on a CUDA machine (bf16, compile, DDP, resume, RNG, sample)
    shape       what a reader holds: lines per file, train.py's imported names, one step's path
    versus      this checkout's training step against another commit's: the two benches in alternating rounds

They run like the user's tools in scripts/ (`python -m`, the reasons are in scripts/__init__.py). One-off
measurements whose numbers live in docs/ were removed after commit df1fd93 (bench_sample, bench_prepare,
vs_nanogpt, bpe_trainers, chat_demo, bench_lora), and past_window after 63259f1: each number there names its
command, and `git show df1fd93:dev/NAME.py` (63259f1 for past_window) has the script.
"""
