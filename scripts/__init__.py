"""The user's tools, each a thin command line over the core, run from the repo root as `python -m scripts.eval
--ckpt out/small`: `-m` puts this checkout first on the module path, nothing installed (an installed copy would let a
second clone's tools run the first's code); run as a file, a tool says so in one line and exits 2. Beside them: the
repo's own checks (gpu_check, shape) and harness.py's offline task (harness_tasks/)."""
import signal
import sys

# python -m scripts.NAME, before the tool imports torch (seconds): Ctrl-C just ends it (unless it is ignored, as in a
# background job); cli.run_tool, the tools' entry, puts Python's handler back.
if sys.argv[:1] == ["-m"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
