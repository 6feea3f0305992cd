"""The user's tools, each a thin command line over the library. Run them from the repo root:

    python -m scripts.eval --ckpt out/small

    eval        val loss and bits per byte of a checkpoint (or GPT-2) on its val split or any text
    harness     lm-evaluation-harness tasks (HellaSwag, LAMBADA, ..., the repo's own in evals/)
    export_hf   a checkpoint -> a folder Hugging Face transformers loads
    doctor      the "my loss won't go down" checklist on your config and data
    bench       training throughput: ms/step, tokens/s, MFU, two configs in alternating rounds
    compare     config variants over several seeds: equal steps, a paired t-test
    plot        loss curves from metrics.jsonl files, run folders or a compare experiment
    tokenizer   a BPE trained on a corpus's train split, reported against char and GPT-2

Why `python -m` and not `python scripts/eval.py`: `-m` puts the working folder first on the module
search path, so a tool imports model.py, train.py, config/ and the project folders from this checkout, with
nothing installed and no sys.path edit. An installed copy (`pip install -e`) would point every
checkout sharing the interpreter at one of them: a second clone's tools would silently run the
first clone's code. The developers' own checks are in dev/.
"""
