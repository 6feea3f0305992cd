"""What a tinygpt process owes the shell and the user: one-line errors and their exit codes (errors), command
lines (cli), files written whole or not at all (files), folders it may write (rundir), and its peers under
torchrun (distributed); and where the checkout is (REPO). Nothing here imports the rest of the project."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the checkout: its entry points, and data/ (the default data_dir)
