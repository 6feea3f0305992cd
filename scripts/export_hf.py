"""Export a trained run to a folder that Hugging Face transformers loads as GPT-2.

    python -m scripts.export_hf out/finetune_shakespeare hf/shakespeare
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('hf/shakespeare')"

Writes model.safetensors, config.json (GPT2LMHeadModel), generation_config.json (generate() stops at block_size,
where the positions end) and the tokenizer, which AutoTokenizer loads to our very ids: vocab.json and merges.txt for
a byte-level BPE, tokenizer.json for a char model (weights/hf.py). docs/interop.md says which tools load the folder
and what each does past block_size.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/export_hf.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.export_hf", file=sys.stderr)
    sys.exit(2)

from pathlib import Path

from weights import hf
from training import lora
from training.checkpoint import load_checkpoint
from config import CommandLine
from weights.loading import find_checkpoint, from_checkpoint
from process.errors import PathError, TinyGPTError, exit_on


def check_folders(out: Path, peft: Path | None) -> None:
    """Every folder the export writes, before anything is loaded or written: each new or empty (hf.check_output),
    and --peft's apart from OUT (each would be written into the other, half-made when the second is refused)."""
    hf.check_output(out, "output folder")
    if peft is None:
        return
    a, b = out.resolve(), peft.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise PathError(f"--peft {peft} and the output folder {out} overlap; give the adapters a folder of their "
                        f"own (e.g. {out}-adapters)")
    hf.check_output(peft, "--peft folder")


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="run folder (its best.pt, else last.pt) or a checkpoint file")
    parser.add_argument("out", help="folder to write: a new or an empty one")
    parser.add_argument("--peft", default="", metavar="DIR",
                        help="a LoRA run (--lora_rank): also write its adapters to DIR, a new or an empty folder, in "
                             "PEFT's format (adapter_config.json, adapter_model.safetensors), for peft.PeftModel on "
                             "the base")
    args = parser.parse_args(argv)
    out, peft = Path(args.out), Path(args.peft) if args.peft else None
    try:
        check_folders(out, peft)  # before loading anything
        path = find_checkpoint(args.run)
        loaded = from_checkpoint(path)
        hf.check_gpt2(loaded.model)  # hf.export's refusal, before --peft's folder is written
        adapters = lora.export_peft(load_checkpoint(path), peft) if peft else []  # refused before writing
        written = hf.export(loaded.model, loaded.tokenizer, out) + adapters  # a LoRA run's: merged
    except TinyGPTError as err:  # one line and its exit code (process/errors.py)
        exit_on(err)
    print(f"exported {path} -> {args.out}: {', '.join(p.name for p in written)}")


if __name__ == "__main__":
    main()
