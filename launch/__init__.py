"""The elastic launcher: `python -m launch` supervises torchrun's elastic agent (see elastic.py)."""
