"""`python deploy/serve.py --engine engines/NAME`: generate the model repository and run tritonserver.

Runs until SIGTERM/SIGINT, then drains: new requests are refused, running ones continue for up to
``--drain-timeout`` seconds and then end with finish_reason "shutdown"; the server's
shared-memory regions and temporary folders are removed. Exits 0 only when tritonserver itself
exited cleanly (1 otherwise; 2 for bad arguments or an unusable engine directory).

The control APIs (model repository, shared memory, logging, trace) need the header
``admin-key: KEY``; KEY is ``--admin-key`` (or $LILICORR_ADMIN_KEY), else a random secret of
this launch, so nobody can load, unload or reconfigure models through the network. Prefer the
environment variable: a key given as ``--admin-key`` stays readable in this process's command line
(``ps``), while tritonserver's copy is overwritten once the server has read it.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from lilicorr.config import DTYPE_CHOICES
from lilicorr.ngram import parse_prompt_lookup

from .launcher import REPO_TMP_PREFIX, ServerStartError, TritonServer, find_tritonserver
from .protocol import DECODE_RULES, DEFAULT_MAX_PROMPT_BYTES
from .repository import EngineSpec, ServeOptions, generate_repository, read_engine_manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("what to serve (an engine dir, or a target + checkpoint)")
    src.add_argument("--engine", help="engine directory made by convert/build_engine.py (has manifest.json)")
    src.add_argument("--target", help="HF target folder: instead of --engine, or with --engine the folder the "
                                      "engine was built for (e.g. after copying the engine elsewhere)")
    src.add_argument("--ckpt", help="drafter+head checkpoint folder (with --target)")
    src.add_argument("--untrained-seed", type=int, default=None,
                     help="with --target and no --ckpt: an untrained drafter+head (smoke tests only)")
    src.add_argument("--block-size", type=int, default=None, help="block size of the untrained drafter")
    src.add_argument("--draft-backend", default=None, help="override the manifest's draft backend")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    net.add_argument("--grpc-port", type=int, default=8001)
    net.add_argument("--http-port", type=int, default=8000)
    net.add_argument("--metrics-port", type=int, default=8002)
    net.add_argument("--admin-key", default=os.environ.get("LILICORR_ADMIN_KEY") or None,
                     help="opens the control APIs (model repository, shared memory, logging, trace) to "
                          "requests with the header 'admin-key: KEY' (default $LILICORR_ADMIN_KEY, which "
                          "keeps the key out of `ps`; without one they are closed to every client)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-batch", type=int, default=32, help="concurrent sequences in the engine")
    eng.add_argument("--max-seq-len", type=int, default=2048, help="prompt + generated tokens per sequence")
    eng.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens a request may ask")
    eng.add_argument("--default-max-tokens", type=int, default=128)
    eng.add_argument("--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES,
                     help="largest text_input / messages_json in bytes, refused before tokenising")
    eng.add_argument("--default-rule", default="lilicorr", choices=DECODE_RULES)
    eng.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    eng.add_argument("--dtype", default="", choices=("",) + DTYPE_CHOICES,
                     help="target precision (default: the engine manifest's serving choice, else auto)")
    eng.add_argument("--draft-length", default="",
                     help="drafted tokens verified per step: N or auto (default: the manifest's, else the whole block)")
    eng.add_argument("--prompt-lookup", default="", metavar="N", type=_prompt_lookup_arg,
                     help="prompt lookup: verify what followed the latest earlier occurrence of a row's last n "
                          "tokens (N >= n >= 2) instead of drafting; off or 0 turns it off (default: the manifest's, "
                          "else off)")
    eng.add_argument("--tree-nodes", type=int, default=0,
                     help="rule tree: draft-tree nodes verified per step (default: the engine's, else 16)")
    eng.add_argument("--num-threads", type=int, default=0,
                     help="torch threads in the engine (0: every core this process may use but one, "
                          "which the server's own threads need)")
    eng.add_argument("--gemm-threads", type=int, default=0,
                     help="threads of the target's multi-token GEMMs: fp16-weights' of 2+ tokens (a verify, a "
                          "prefill, several rows; through Triton on 2 cores 2 measured slower than 1: "
                          "results/gemm_threads_epyc/), bf16-gemm's GEMMs and attention of 32+ (a prefill, "
                          "many rows) (0: --num-threads)")
    eng.add_argument("--prefill-threads", type=int, default=0,
                     help="GEMM threads while prefilling new requests (0: --gemm-threads)")
    eng.add_argument("--no-chat-template", action="store_true",
                     help="tokenize text_input raw instead of as a chat user message")
    eng.add_argument("--profile", action="store_true",
                     help="time the Table 3 stages in the engine thread (lilicorr_stage_seconds on /metrics)")
    srv = p.add_argument_group("server")
    srv.add_argument("--repo", help="write the model repository here and keep it (default: a temp dir)")
    srv.add_argument("--tritonserver", choices=["auto", "wheel", "system"], default="auto",
                     help="which binary: the nvidia-pytriton wheel's, or `tritonserver` on PATH (NGC)")
    srv.add_argument("--log-verbose", type=int, default=0)
    srv.add_argument("--drain-timeout", type=float, default=30.0,
                     help="at SIGTERM/SIGINT: seconds running requests may continue before they end with "
                          "finish_reason 'shutdown' (new requests are refused at once)")
    srv.add_argument("--exit-timeout", type=int, default=10,
                     help="tritonserver's own --exit-timeout-secs after the drain")
    srv.add_argument("--startup-timeout", type=float, default=600.0)
    srv.add_argument("--print-repo", action="store_true", help="only generate the repository and print its path")
    return p


def spec_from_args(args: argparse.Namespace) -> EngineSpec:
    if args.engine:
        return read_engine_manifest(args.engine, target=args.target)
    if not args.target:
        raise SystemExit("serve: pass --engine DIR (or --target DIR [--ckpt DIR])")
    return EngineSpec(target_dir=Path(args.target).resolve(),
                      ckpt_dir=Path(args.ckpt).resolve() if args.ckpt else None,
                      draft_backend=args.draft_backend or "torch")


def _prompt_lookup_arg(value: str) -> str:
    """Check --prompt-lookup when it is parsed (a one-line usage error); keep the text, since ""
    means the manifest's choice."""
    try:
        parse_prompt_lookup(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    extra = {}
    if args.untrained_seed is not None and not args.engine and not args.ckpt:
        extra["untrained_seed"] = str(args.untrained_seed)
    if args.block_size:
        extra["block_size"] = str(args.block_size)
    return ServeOptions(max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                        max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                        default_decode_rule=args.default_rule, device=args.device, dtype=args.dtype,
                        draft_length=args.draft_length, tree_nodes=args.tree_nodes,
                        prompt_lookup=args.prompt_lookup, num_threads=args.num_threads, gemm_threads=args.gemm_threads,
                        prefill_threads=args.prefill_threads,
                        draft_backend=args.draft_backend,
                        chat_template=not args.no_chat_template, profile=args.profile,
                        max_prompt_bytes=args.max_prompt_bytes, extra_parameters=extra)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lilicorr.engine_dir import EngineDirError
    try:
        spec = spec_from_args(args)
        opts = options_from_args(args)
    except (EngineDirError, FileNotFoundError, ValueError) as e:   # one line, no traceback
        print(f"serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    tmp = None
    if args.repo:
        repo_dir = Path(args.repo)
    else:
        tmp = tempfile.TemporaryDirectory(prefix=f"{REPO_TMP_PREFIX}{os.getpid()}-")
        repo_dir = Path(tmp.name)
    try:
        generate_repository(spec, repo_dir, opts)
        if args.print_repo:
            print(repo_dir)
            if tmp is not None:
                tmp = None  # keep it: the user asked for its path
            return 0
        stop = threading.Event()
        received: list[int] = []

        def on_signal(signum, frame):  # noqa: ARG001
            received.append(signum)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        binary = find_tritonserver(args.tritonserver)
        print(f"[serve] {binary.kind} tritonserver {binary.path}", flush=True)
        print(f"[serve] repository {repo_dir} (target {spec.target_dir}, engine {spec.engine_dir})", flush=True)
        server = TritonServer(repo_dir, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                              metrics_port=args.metrics_port, binary=binary, log_file="-",
                              log_verbose=args.log_verbose, startup_timeout=args.startup_timeout,
                              exit_timeout=args.exit_timeout, admin_key=args.admin_key,
                              drain_timeout=args.drain_timeout,
                              cleanup_paths=[repo_dir] if tmp is not None else [])
        server.abort = stop
        try:
            try:
                server.start()
            except ServerStartError as e:
                if stop.is_set():
                    print("[serve] interrupted during startup", flush=True)
                    return 0
                print(f"serve: error: {e}", file=sys.stderr, flush=True)
                return 1
            print(f"[serve] ready: grpc {server.grpc_url}  http {server.http_url}  metrics {server.metrics_url}",
                  flush=True)
            while not stop.wait(0.5):
                if server.proc is None or server.proc.poll() is not None:
                    print(f"[serve] tritonserver exited unexpectedly (code "
                          f"{server.proc.returncode if server.proc else None})", file=sys.stderr, flush=True)
                    return 1
            print(f"[serve] signal {received[0] if received else '?'}: draining (up to "
                  f"{args.drain_timeout:g} s), then shutting down", flush=True)
        finally:
            rc = server.stop()
        if server.killed:
            print("[serve] tritonserver did not exit within its exit timeout (a client keeping a gRPC "
                  "stream open holds it in 2.51); it was killed", file=sys.stderr, flush=True)
        print(f"[serve] stopped (tritonserver exit code {rc})", flush=True)
        return 0 if rc == 0 else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
