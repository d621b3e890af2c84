#!/usr/bin/env python3
"""Serve an engine with Triton Inference Server: python deploy/serve.py --engine engines/NAME

See `python deploy/serve.py --help` and lilicorr/serving/serve.py.
"""
import sys

from lilicorr.serving.serve import main

if __name__ == "__main__":
    sys.exit(main())
