#!/usr/bin/env bash
# Table 3 stage decomposition: stage timer everywhere, `nsys profile -t cuda,nvtx` with --nsys.
# Usage: deploy/profile.sh [--nsys] [--ckpt DIR | --engine-dir DIR] [--rules ...] (see --help)
exec python "$(dirname "$0")/stage_profile.py" "$@"
