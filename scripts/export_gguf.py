"""Export a trained run to one GGUF file, which llama.cpp (Ollama, LM Studio, llama-cpp-python) runs as GPT-2.

    python -m scripts.export_gguf out/tiny tiny.gguf --dtype f16
    python -c "from llama_cpp import Llama; print(Llama('tiny.gguf').tokenize(b'Hello', add_bos=False))"

The weights, the context length (block_size) and the tokenizer, which llama.cpp encodes to our very ids
(char, bpe and gpt2 runs alike); needs the gguf package (requirements-interop.txt). A model llama.cpp's
GPT-2 cannot compute (RoPE, RMSNorm, ...) is refused in one line. The mapping is weights/gguf.py's.
OUT is a new .gguf file, or a GGUF file to replace, never anything else (a checkpoint, a log: hf.check_output);
an existing folder gets FOLDER/<run>.gguf.
"""
from __future__ import annotations

import sys

if not __package__:  # run as a file, `python scripts/export_gguf.py`: its folder, not the repo, leads the module path
    print("error: run it from the repo root as a module: python -m scripts.export_gguf", file=sys.stderr)
    sys.exit(2)

from pathlib import Path

from config import CommandLine
from process.errors import TinyGPTError, exit_on, fail, install_hint
from weights.gguf import DTYPES, export_gguf
from weights.hf import check_output
from weights.loading import find_checkpoint, from_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = CommandLine(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="run folder (its best.pt, else last.pt) or a checkpoint file")
    parser.add_argument("out", help="the .gguf file to write (a GGUF file there is replaced), or a folder for "
                                    "FOLDER/<run>.gguf")
    parser.add_argument("--dtype", choices=DTYPES, default="f32",
                        help="how the matrices are stored: f32 (exact), f16 (half the size), q8_0 (8-bit blocks)")
    args = parser.parse_args(argv)
    try:  # the paths first: without gguf installed too, and before a checkpoint is loaded
        path = find_checkpoint(args.run)
        run_name = Path(path).resolve().parent.name
        out = Path(args.out) / f"{run_name}.gguf" if Path(args.out).is_dir() else Path(args.out)
        check_output(out, "output folder", ".gguf")
    except TinyGPTError as err:  # one line and its exit code (process/errors.py)
        exit_on(err)
    try:
        import gguf  # noqa: F401 - only to say how to get it before a checkpoint is loaded
    except ImportError:
        fail(f"the GGUF export writes with llama.cpp's gguf package: {install_hint('gguf')}")
    try:
        loaded = from_checkpoint(path)
        count = export_gguf(loaded.model, loaded.tokenizer, out, args.dtype, name=run_name)
    except TinyGPTError as err:
        exit_on(err)
    folder_note = f" ({args.out} is a folder: the file is named for the run)" if out != Path(args.out) else ""
    print(f"exported {path} -> {out}: {count} tensors, {args.dtype}{folder_note}")


if __name__ == "__main__":
    main()
