#!/usr/bin/env python
"""Serve an exported model over HTTP: `python tools/serve.py MODEL.onnx [--host 0.0.0.0] [--port 8000]`."""
import sys

from d2export.runtime import serve_main

if __name__ == "__main__":
    sys.exit(serve_main())
