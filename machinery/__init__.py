"""The machinery the four core files (model.py, data.py, train.py, sample.py) call, one concern a module.

    checkpoint   what last.pt and best.pt hold, atomic writes, verified reads, the resume policy (Checkpointer)
    tracking     metrics.jsonl and Weights & Biases (MetricsLog), ms/step and MFU (Throughput)
    faults       signals, the NaN/inf guard, and the exit codes (exit_for)
    distributed  DDP under torchrun: setup, rank agreement, teardown
    runtime      where and how a run computes (choose_runtime: device, threads, precision, compile), MFU
    rundir       one live run per out_dir; writable folders
    optim        the optimizers and lr decays, as tables
    hf           GPT-2 / Hugging Face weights in and out; init_from (start_from)
    corpora      corpus preparation: the built-in corpus's download, text files, document formats
                 (DOCUMENT_FORMATS), worker pools, staging, and python data.py's command line
    tokenfiles   a tokenized folder on disk (train.bin, val.bin, meta.json) and its verification
    tokenizers   GPT-2's byte-level BPE through tiktoken (data.CharTokenizer is the textbook one)

Read the core first (README, "Read the code in this order"); these are the second pass. Nothing here is
imported by this file: each module is imported where it is used.
"""
