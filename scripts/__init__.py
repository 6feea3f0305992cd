"""The user's tools, each a thin command line over the library, run from the repo root (README.md lists them; each
file opens with its commands):

    python -m scripts.eval --ckpt out/small

Why `python -m` and not `python scripts/eval.py`: `-m` puts the working folder first on the module
search path, so a tool imports model.py, train.py, config/ and the project folders from this checkout, with
nothing installed and no sys.path edit. An installed copy (`pip install -e`) would point every
checkout sharing the interpreter at one of them: a second clone's tools would silently run the
first clone's code. The developers' own checks are in dev/.
"""
