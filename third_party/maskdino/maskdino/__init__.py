"""MaskDINO's inference rules (IDEA-Research/MaskDINO, `maskdino/maskdino.py`), for tests: see ../README.md."""
