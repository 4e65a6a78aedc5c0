#!/usr/bin/env python
"""Run an exported model on pictures: `python tools/infer.py MODEL.onnx IMAGE_OR_FOLDER … [-o out.jsonl] [--vis DIR]`."""
import sys

from d2export.runtime import infer_main

if __name__ == "__main__":
    sys.exit(infer_main())
