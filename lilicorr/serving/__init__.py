"""Serving on Triton Inference Server: model repository generation (`repository`), the server
launcher (`launcher.TritonServer`), the in-flight batching engine thread (`engine_loop`), the
gRPC client (`client.LiLiCorrClient`) and the load benchmark (`benchmark`). See README.md here.

Kept import-light: the Triton stub imports this package for every Python model.
"""
