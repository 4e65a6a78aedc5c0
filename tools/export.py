#!/usr/bin/env python
"""Export a detectron2 model to verified ONNX: `python tools/export.py --config textdet.yaml [key=value …]`."""
import sys

from d2export.cli import export_main

if __name__ == "__main__":
    sys.exit(export_main())
