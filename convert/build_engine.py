"""Checkpoint -> engine directory (drafter + head graphs, target reference, manifest).

    python convert/build_engine.py --ckpt out/ [--target DIR] [--out engines/NAME]
                                   [--backend onnxruntime|tensorrt|tensorrt-rtx]

onnxruntime (default, CPU): ONNX graphs + ORT-optimised copies, validated against PyTorch, and
int8 copies of the drafter's graphs that the engine serves (--draft-weights; drafts only: the target
verifies every token).
tensorrt: serialized TensorRT engines with the lilicorr plugins (needs `tensorrt`, NVIDIA's
containers). tensorrt-rtx: TensorRT-RTX engines built on the CPU for SM80/86/89/120, with the
plugins and, as a second variant, through the ONNX local functions. engines/README.md describes
the directory and its manifest. The logic lives in `lilicorr.export` (importable).
"""
from __future__ import annotations

import argparse
import sys

from lilicorr.config import DTYPE_CHOICES
from lilicorr.engine_dir import BACKENDS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint directory written by train/train.py")
    p.add_argument("--target", default=None,
                   help="HF folder of the frozen target (default: the one the checkpoint records, else the "
                        "default CPU target .cache/smollm2-135m-instruct-float32 when it matches)")
    p.add_argument("--out", default=None, help="engine directory (default engines/<ckpt name>-<backend>)")
    p.add_argument("--backend", default="onnxruntime", help=f"one of {', '.join(BACKENDS)} (default onnxruntime)")
    p.add_argument("--max-batch", type=int, default=32, help="TensorRT profile: max rows (default 32)")
    p.add_argument("--max-context", type=int, default=2048, help="TensorRT profile: max cached context (2048)")
    p.add_argument("--compute-capabilities", default=None,
                   help="TensorRT-RTX targets, comma separated (default SM80,SM86,SM89,SM120)")
    p.add_argument("--serve-dtype", default="auto",
                   choices=DTYPE_CHOICES,
                   help="target precision the manifest asks servers to use (auto: bf16 on CUDA and on AMX "
                        "CPUs; on other CPUs bf16-gemm with AVX512-BF16, else fp16-weights where fbgemm has "
                        "it, else fp32)")
    p.add_argument("--draft-length", default="auto",
                   help="drafted tokens verified per step recorded for serving: auto (the default: per row "
                        "and step, what pays for itself at the current load), N, or '' (the whole block)")
    p.add_argument("--prompt-lookup", default=None, metavar="N",
                   help="prompt lookup recorded for serving: where a row's last n tokens (N >= n >= 2) occurred "
                        "before, verify what followed them instead of drafting (default 3; off or 0: never)")
    p.add_argument("--tree-nodes", type=int, default=None,
                   help="rule tree's node budget M built into the draft graph (lilicorr::DraftTree; default 16, "
                        "0: none; serving uses it unless told another M)")
    p.add_argument("--draft-weights", default="auto", choices=("auto", "int8", "float32"),
                   help="weights of the drafter graphs ONNX Runtime serves: int8 (dynamic quantization, per "
                        "channel) or float32 (exactly the PyTorch drafter); auto (default): int8 for onnxruntime, "
                        "float32 for TensorRT")
    p.add_argument("--yarn-factor", type=float, default=None, help="bake YaRN rope scaling into the graphs")
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="max abs error ORT vs PyTorch above which the build fails (default 1e-3)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from lilicorr.checkpoint import CheckpointError
    from lilicorr.engine_dir import EngineDirError
    from lilicorr.export import BuildError, BuildOptions, build_engine_dir

    opts = BuildOptions(backend=args.backend, max_batch=args.max_batch, max_context=args.max_context,
                        compute_capabilities=args.compute_capabilities.split(",") if args.compute_capabilities else None,
                        yarn_factor=args.yarn_factor, tolerance=args.tolerance,
                        dtype=args.serve_dtype, draft_length=args.draft_length, draft_weights=args.draft_weights,
                        **({} if args.tree_nodes is None else {"tree_nodes": args.tree_nodes}),
                        **({} if args.prompt_lookup is None else {"prompt_lookup": args.prompt_lookup}),
                        log=lambda *a: print(*a, flush=True))
    try:
        out = build_engine_dir(args.ckpt, args.target, args.out, opts)
    except (BuildError, CheckpointError, EngineDirError, FileNotFoundError, ValueError) as e:
        print(f"build_engine: error: {e}", file=sys.stderr)
        return 2
    import json
    m = json.loads((out / "manifest.json").read_text())
    v = m["validation"]
    print(f"engine {out}  backend={m['backend']}  B={m['block_size']} K={m['top_k']} sigma={m['sigma']}  "
          f"max_abs_err={v['max_abs_err']:.3g}  tokens_equal={v['draft']['tokens_equal']}  "
          f"cand_ids_equal={v['draft']['cand_ids_equal']}  draft_weights={m.get('draft_weights', 'float32')}")
    if "int8" in v:
        q = v["int8"]
        print(f"  int8 drafter: token agreement {q['token_agreement']:.1%}, candidate ids {q['cand_id_agreement']:.1%} "
              f"with PyTorch on the sample inputs, max abs err {q['max_abs_err']:.3g}")
    if m.get("tensorrt"):
        for k, p in m["tensorrt"]["plans"].items():
            print(f"  {p['file']}: plugins={p['plugins']} ({p['size_bytes']} bytes, {p['build_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
