"""The user's tools, each a thin command line over the library, run from the repo root as `python -m scripts.eval
--ckpt out/small` (README.md lists them; each file opens with its commands). `-m` puts the working folder first on
the module search path, so a tool imports this checkout's code with nothing installed and no sys.path edit; an
installed copy (`pip install -e`) would make a second clone's tools silently run the first clone's code. Run as a
file (`python scripts/eval.py`), a tool says so in one line and exits 2. Beside the user's tools: the developers'
checks of the repo itself (gpu_check, shape) and harness.py's offline task (harness_tasks/)."""
import signal
import sys

# python -m scripts.NAME, before the tool imports torch (seconds): Ctrl-C just ends it (unless it is ignored, as in a
# background job); cli.run_tool, the tools' entry, puts Python's handler back.
if sys.argv[:1] == ["-m"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
