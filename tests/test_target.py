"""TargetModel vs transformers, KVCache ragged decoding and rollback, RoPE scaling, SmolLM2 (slow)."""
from __future__ import annotations

import json

import pytest
import torch

from lilicorr.bf16_gemm import _missing as bf16_gemm_missing
from lilicorr.kv_cache import KVCache
from lilicorr.rope import RotaryEmbedding, with_yarn
from lilicorr.target import TargetConfig, load_target

transformers = pytest.importorskip("transformers")

VARIANTS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}),
]


def _hf(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def _close(a, b, rel=1e-5):
    scale = b.abs().max().clamp_min(1.0)
    assert (a.float() - b.float()).abs().max() <= rel * scale, (a.float() - b.float()).abs().max()


def _positions(n, t):
    return torch.arange(t).expand(n, t)


@pytest.mark.parametrize("family,overrides", VARIANTS)
@torch.no_grad()
def test_logits_and_captures_match_transformers(tiny_target_dir, family, overrides):
    path = tiny_target_dir(family, **overrides)
    ours, ref = load_target(path), _hf(path)
    assert not any(p.requires_grad for p in ours.parameters()) and not ours.training
    cfg = ours.config
    assert cfg.qk_norm == (family == "qwen3") and cfg.attention_bias == (family == "qwen2" or "attention_bias" in overrides)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    capture = (2, 0, cfg.num_hidden_layers - 1)
    out = ours(ids, _positions(2, 13), capture=capture)
    r = ref(ids, output_hidden_states=True)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, 13, cfg.vocab_size)
    _close(out.logits, r.logits)
    assert out.captured.shape == (2, 13, 3, cfg.hidden_size)
    for i, k in enumerate(capture):
        _close(out.captured[:, :, i], r.hidden_states[k + 1])
    _close(out.last_hidden, r.hidden_states[-1])
    # the frozen embedding and head are the public entry points the drafter uses
    _close(ours.embed(ids), ref.get_input_embeddings()(ids))
    _close(ours.lm_head(out.last_hidden), r.logits)
    if cfg.tie_word_embeddings:
        assert ours.lm_head.weight is ours.embed_tokens.weight
    assert ours(ids, _positions(2, 13), logits=False).logits is None


BF16_EPS = 2.0 ** -8          # relative spacing of bfloat16 numbers (8 significand bits)


@pytest.mark.parametrize("family,overrides", [("qwen3", {}), ("llama", {}), ("qwen2", {"tie_word_embeddings": True})])
@torch.no_grad()
def test_bf16_weights_give_fp32_logits(tiny_target_dir, family, overrides):
    """In bf16 with PyTorch's kernels the model runs the same arithmetic as transformers in bf16: the
    logits agree to one bf16 step at the largest logit (they are equal in practice; the step leaves
    room for a different reduction order). Against fp32 the bf16 error is a property of the dtype,
    not a tolerance: it must be no larger than transformers' own bf16 error, plus that step; the
    same holds for the batch-invariant kernels (the default for bf16 on a CPU), which round in
    other places."""
    path = tiny_target_dir(family, **overrides)
    ours, ref = load_target(path, dtype="bfloat16", batch_invariant=False), _hf(path, torch.bfloat16)
    assert ours.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    out = ours(ids, _positions(2, 9))
    assert out.logits.dtype == torch.float32 and out.last_hidden.dtype == torch.bfloat16
    ref16 = ref(ids).logits.float()
    fp32 = load_target(path)(ids, _positions(2, 9)).logits
    step = BF16_EPS * float(fp32.abs().max())
    assert float((out.logits - ref16).abs().max()) <= step, (out.logits - ref16).abs().max()
    ref_err = float((ref16 - fp32).abs().max())
    assert ref_err > 0                     # bf16 really ran (fp32 would match exactly)
    invariant = load_target(path, dtype="bfloat16")
    for model in (ours, invariant):
        err = float((model(ids, _positions(2, 9)).logits - fp32).abs().max())
        assert err <= ref_err + step, (model.batch_invariant, err, ref_err)


@pytest.mark.parametrize("family,overrides", [("qwen3", {}), ("llama", {"tie_word_embeddings": True}),
                                              ("qwen2", {})])
@torch.no_grad()
def test_fp16_weights_are_transformers_on_fp16_rounded_matrices(tiny_target_dir, family, overrides):
    """precision fp16-weights is exactly stated: transformers in fp32 with every weight matrix
    (linears and the embedding) rounded to fp16 gives the same logits, to fp32 reduction order.
    Norms and biases stay fp32; a tied embedding is rounded once and still shared."""
    from lilicorr.fp16_linear import FP16WeightLinear, fp16_exact
    path = tiny_target_dir(family, **overrides)
    ours, ref = load_target(path, dtype="fp16-weights"), _hf(path)
    assert ours.precision == "fp16-weights" and load_target(path).precision == "float32"
    assert isinstance(ours.lm_head, FP16WeightLinear) and isinstance(ours.layers[0].mlp.down_proj, FP16WeightLinear)
    assert ours.embed_tokens.weight.dtype == torch.float32 and fp16_exact(ours.embed_tokens.weight)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == bool(overrides.get("tie_word_embeddings"))
    for name, w in ref.named_parameters():
        if w.dim() == 2:
            w.copy_(w.half().float())
    ids = torch.randint(0, ours.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    out = ours(ids, _positions(2, 11))
    assert out.logits.dtype == torch.float32
    _close(out.logits, ref(ids).logits)
    fp32 = load_target(path)(ids, _positions(2, 11)).logits      # and it really differs from fp32
    assert float((fp32 - out.logits).abs().max()) > 0


needs_bf16_gemm = pytest.mark.skipif(bool(bf16_gemm_missing()), reason=f"bf16-gemm: {bf16_gemm_missing()}")


@needs_bf16_gemm
@pytest.mark.parametrize("family,overrides", [("qwen3", {}), ("llama", {"tie_word_embeddings": True}),
                                              ("qwen2", {})])
@torch.no_grad()
def test_bf16_gemm_is_transformers_on_bf16_rounded_matrices_and_gemm_inputs(tiny_target_dir, family, overrides):
    """precision bf16-gemm is what it says: transformers in fp32 with every weight matrix (linears
    and the embedding) rounded to bf16 and every linear's input rounded to bf16 gives the same logits
    and argmax. Norms, biases, attention and the residual stream stay fp32; a tied embedding is
    rounded once and still shared. "The same" up to fp32 reduction order, which rounding an input to
    bf16 can turn into one bf16 step where a value sits on a rounding boundary: so the bound is that
    the reference is several times closer than transformers with the weights rounded alone."""
    from lilicorr.bf16_gemm import BF16GemmLinear, bf16_exact
    path = tiny_target_dir(family, **overrides)
    ours, ref = load_target(path, dtype="bf16-gemm"), _hf(path)
    assert ours.precision == "bf16-gemm"
    assert isinstance(ours.lm_head, BF16GemmLinear) and isinstance(ours.layers[0].mlp.down_proj, BF16GemmLinear)
    assert ours.embed_tokens.weight.dtype == torch.float32 and bf16_exact(ours.embed_tokens.weight)
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == bool(overrides.get("tie_word_embeddings"))
    weights_only = _hf(path)
    for model in (ref, weights_only):
        for name, w in model.named_parameters():
            if w.dim() == 2:
                w.copy_(w.bfloat16().float())
    for m in ref.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: (args[0].bfloat16().float(),) + tuple(args[1:]))
    ids = torch.randint(0, ours.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    out = ours(ids, _positions(2, 11))
    assert out.logits.dtype == torch.float32
    want = ref(ids).logits
    assert torch.equal(out.logits.argmax(-1), want.argmax(-1))
    err, other = (float((out.logits - r).abs().max()) for r in (want, weights_only(ids).logits))
    assert err <= 0.4 * other, (err, other)
    fp16 = load_target(path, dtype="fp16-weights")(ids, _positions(2, 11)).logits   # and it is not fp16-weights
    assert float((fp16 - out.logits).abs().max()) > 0


@needs_bf16_gemm
def test_bf16_gemm_kernel_rows_are_independent_of_the_call():
    """The bf16 kernel: fp32 sums of bf16-rounded products (against a float64 reference), any shape
    (odd inputs, outputs not a multiple of its 48-column groups, a bias or none, [..., I] inputs),
    and every output row the same bits whatever rows share the call and on 1 or 2 threads (calls of
    PARALLEL_ROWS rows or more split their columns over torch's threads, or over `set_gemm_threads`'
    count with torch on one): what makes a k-token verify decide as k one-token steps, and a prefill
    as the steps it replaces. Bad inputs are refused with a reason."""
    from lilicorr.bf16_gemm import PARALLEL_ROWS, PackedBF16, kernels
    from lilicorr.fp16_linear import set_gemm_threads
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    rows = PARALLEL_ROWS + 9
    try:
        for out_f, in_f, with_bias in [(96, 64, False), (37, 101, True), (576, 576, True), (2000, 48, False)]:
            w = torch.randn(out_f, in_f, generator=g) * 0.05
            bias = torch.randn(out_f, generator=g) if with_bias else None
            x = torch.randn(rows, in_f, generator=g)
            gemm = PackedBF16(w, bias)
            torch.set_num_threads(1)
            full = gemm(x)                                                   # [rows, O]
            want = x.bfloat16().double() @ w.bfloat16().double().T + (bias.double() if with_bias else 0)
            assert full.dtype == torch.float32 and full.shape == (rows, out_f)
            assert float((full.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()) * in_f ** 0.5
            for threads, gemm_threads in [(1, 0), (2, 0), (1, 2)]:
                torch.set_num_threads(threads)
                set_gemm_threads(gemm_threads)
                for lo, hi in [(0, 1), (4, 5), (0, 2), (1, 4), (6, 10), (0, 5), (0, 8), (3, 12), (0, 16), (2, 19), (18, 19),
                               (0, rows), (5, rows)]:        # each row count the kernel tiles its own way
                    assert torch.equal(gemm(x[lo:hi]), full[lo:hi]), (out_f, in_f, threads, gemm_threads, lo, hi)
                assert torch.equal(gemm(x[:6].reshape(2, 3, in_f)), full[:6].reshape(2, 3, out_f))
                assert torch.get_num_threads() == threads                   # raised for the call alone
            set_gemm_threads(0)
            assert gemm(x[:0]).shape == (0, out_f)
        with pytest.raises(RuntimeError, match="features"):
            gemm(torch.randn(2, in_f + 2))
        with pytest.raises(RuntimeError, match="2-D"):
            kernels().pack(torch.randn(3))
    finally:
        set_gemm_threads(0)
        torch.set_num_threads(before)


@needs_bf16_gemm
def test_bf16_gemm_attention_computes_each_query_alone():
    """bf16-gemm's attention kernel (`fused_attention`): `invariant_attention`'s result to float32
    rounding, for head sizes that are and are not a multiple of 16, grouped-query layouts and a
    per-row mask; and each query's bits the same when it is computed alone, over fewer keys read
    (masked keys are skipped, not added as zeros), on 1 or 2 threads (a call of PARALLEL_ROWS
    queries or more splits them over threads). Bad shapes are refused."""
    from lilicorr.batch_invariant import invariant_attention
    from lilicorr.bf16_gemm import PARALLEL_ROWS, fused_attention
    from lilicorr.fp16_linear import set_gemm_threads
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    t_len = PARALLEL_ROWS // 2 + 4                      # queries per row: 2 rows together split, one alone not
    try:
        for d, hq, hkv in [(64, 9, 3), (24, 4, 2), (128, 2, 2)]:
            q = torch.randn(2, hq, t_len, d, generator=g) * 2
            k, v = (torch.randn(2, hkv, 256, d, generator=g) for _ in range(2))
            seen = torch.tensor([[100], [50]]) + torch.arange(t_len)                               # [N, T]
            mask = torch.zeros(2, 1, t_len, 256).masked_fill_(torch.arange(256) >= seen[:, None, :, None],
                                                              float("-inf"))
            torch.set_num_threads(1)
            together = fused_attention(q, k, v, mask)                                             # [N, hq, T, D]
            want = invariant_attention(q, k, v, mask)
            assert float((together - want).abs().max()) <= 1e-5 * float(want.abs().max())
            for threads, gemm_threads in [(1, 0), (2, 0), (1, 2)]:
                torch.set_num_threads(threads)
                set_gemm_threads(gemm_threads)
                assert torch.equal(fused_attention(q, k, v, mask), together), (d, threads, gemm_threads)
                for t in range(t_len):
                    alone = fused_attention(q[:, :, t:t + 1], k[:, :, :128], v[:, :, :128], mask[:, :, t:t + 1, :128])
                    assert torch.equal(alone, together[:, :, t:t + 1]), (d, threads, t)
                assert torch.equal(fused_attention(q[1:], k[1:], v[1:], mask[1:]), together[1:])
                # a packed call: row 0's queries from 3 on and row 1's from 7 on are padding
                packed = fused_attention(q, k, v, mask, live=torch.tensor([3, 7]))
                assert torch.equal(packed[0, :, :3], together[0, :, :3]) and torch.equal(packed[1, :, :7], together[1, :, :7])
                assert not packed[0, :, 3:].any() and not packed[1, :, 7:].any()
            set_gemm_threads(0)
        with pytest.raises(RuntimeError, match="shapes do not fit"):
            fused_attention(q[:, :1], k, v, mask)
    finally:
        set_gemm_threads(0)
        torch.set_num_threads(before)


def test_packed_fp16_gives_the_same_bits_on_one_thread_and_two():
    """`PackedFP16` runs fbgemm's one-thread op at 1 thread and the quantized engine's parallel op
    above; every output row is the same bits either way, at every number of rows (so a k-token
    verify and a 1-token step agree at either thread count), with and without a bias, and each
    packing is made once, when first used. `set_gemm_threads` sets the count (0: torch's) and
    refuses a negative one."""
    from lilicorr.fp16_linear import PackedFP16, gemm_threads, set_gemm_threads
    set_gemm_threads(3)
    assert gemm_threads() == 3
    set_gemm_threads(0)
    assert gemm_threads() == torch.get_num_threads()
    with pytest.raises(ValueError, match="must be >= 0"):
        set_gemm_threads(-1)
    g = torch.Generator().manual_seed(0)
    before = torch.get_num_threads()
    try:
        for out_f, in_f, with_bias in [(96, 64, False), (37, 100, True)]:
            w = (torch.randn(out_f, in_f, generator=g) * 0.05).half().float()
            bias = torch.randn(out_f, generator=g) if with_bias else None
            x = torch.randn(9, in_f, generator=g)
            gemm = PackedFP16(w, bias)
            torch.set_num_threads(1)
            one = gemm(x)                                           # [9, O]
            assert gemm._single is not None and gemm._parallel is None
            want = x @ w.T + (bias if with_bias else 0)
            assert torch.allclose(one, want, rtol=1e-4, atol=1e-4)
            torch.set_num_threads(2)
            for m in range(1, 10):
                assert torch.equal(gemm(x[:m]), one[:m]), (out_f, m)
                assert torch.equal(gemm(x[:m].reshape(1, m, in_f)), one[:m].reshape(1, m, out_f))
            assert gemm._parallel is not None
    finally:
        torch.set_num_threads(before)


def test_precision_names_resolve(monkeypatch):
    """auto: bf16 on CUDA and on CPUs with AMX-BF16; on other CPUs bf16-gemm where the CPU has
    AVX512-BF16 and the kernel can be built, else fp16-weights where fbgemm has it, else fp32;
    fp16-weights and bf16-gemm compute in float32 and are refused on CUDA; unknown names are
    refused; NAME:plain asks for PyTorch's own kernels."""
    import lilicorr.bf16_gemm as bg
    import lilicorr.fp16_linear as fl
    import lilicorr.target as tg
    assert tg.resolve_precision("auto", "cuda") == "bfloat16" and tg.resolve_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(tg, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(bg, "bf16_gemm_available", lambda: True)
    assert tg.resolve_precision("auto") == "bf16-gemm" and tg.resolve_dtype("auto") == torch.float32
    with pytest.raises(ValueError, match="CPU precision"):
        tg.resolve_precision("bf16-gemm", "cuda")
    monkeypatch.setattr(bg, "bf16_gemm_available", lambda: False)
    monkeypatch.setattr(tg, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(fl, "fbgemm_fp16_available", lambda: True)
    assert tg.resolve_precision(None) == "fp16-weights" and tg.resolve_dtype("auto") == torch.float32
    monkeypatch.setattr(fl, "fbgemm_fp16_available", lambda: False)
    assert tg.resolve_precision("auto") == "float32"
    monkeypatch.setattr(tg, "cpu_has_native_bf16", lambda: True)
    assert tg.resolve_precision("auto") == "float32"
    monkeypatch.setattr(fl, "fbgemm_fp16_available", lambda: True)
    assert tg.resolve_precision("auto") == "fp16-weights"
    monkeypatch.setattr(tg, "cpu_has_amx_bf16", lambda: True)
    assert tg.resolve_precision("auto") == "bfloat16" and tg.resolve_dtype(None) == torch.bfloat16
    assert tg.resolve_precision("fp16-weights") == "fp16-weights"        # a name asked for stays
    assert tg.resolve_precision(torch.float16) == "float16" and tg.resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="CPU precision"):
        tg.resolve_precision("fp16-weights", "cuda")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        tg.resolve_precision("int8")
    assert tg.precision_variant("bfloat16") == ("bfloat16", None)
    assert tg.precision_variant("bfloat16:plain") == ("bfloat16", False)
    with pytest.raises(ValueError, match="only variant"):
        tg.precision_variant("bfloat16:fast")


def _greedy_full(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Reference: recompute the whole sequence without a cache for every new token."""
    ids, logits = list(ids), []
    for _ in range(steps):
        x = torch.tensor([ids])
        lg = model(x, _positions(1, len(ids))).logits[0, -1]
        logits.append(lg)
        ids.append(int(lg.argmax()))
    return ids, logits


@torch.no_grad()
def test_ragged_batched_cache_decoding_equals_full_recompute(tiny_target_dir):
    model = load_target(tiny_target_dir("llama"))
    cache = KVCache(4, 5, 2, 16, capacity=4)               # tiny capacity: forces growth
    slots = [cache.allocate() for _ in range(5)]
    cache.free(slots[1])
    rows = torch.tensor([slots[3], slots[0], slots[4]])    # not consecutive: gather path
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 96, (n,), generator=g).tolist() for n in (5, 9, 3)]
    lens = torch.tensor([len(p) for p in prompts])
    t = int(lens.max())
    ids = torch.full((3, t), 3)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    out = model(ids, _positions(3, t), cache=cache, rows=rows, valid=lens)
    assert cache.lengths[rows].tolist() == lens.tolist() and cache.capacity >= t
    nxt = out.logits[torch.arange(3), lens - 1].argmax(-1)     # [3]
    seqs = [p + [int(nxt[i])] for i, p in enumerate(prompts)]
    for _ in range(6):
        pos = cache.lengths[rows][:, None]                      # [3, 1]
        step = model(nxt[:, None], pos, cache=cache, rows=rows)
        nxt = step.logits[:, -1].argmax(-1)
        for i in range(3):
            seqs[i].append(int(nxt[i]))
    for i, p in enumerate(prompts):
        ref, _ = _greedy_full(model, p, 7)
        assert seqs[i] == ref
    assert cache.lengths[rows].tolist() == (lens + 6).tolist()


@torch.no_grad()
def test_multi_token_verify_block_with_ragged_valid(tiny_target_dir):
    """The engine's verify pattern: a block of tokens per row on top of a cache, ragged `valid`."""
    model = load_target(tiny_target_dir("qwen2"))
    cache = model.new_cache(num_slots=3, capacity=8)
    rows = torch.tensor([cache.allocate() for _ in range(3)])  # consecutive: slice path
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, 96, (3, 6), generator=g)
    model(prompt, _positions(3, 6), cache=cache, rows=rows)
    block = torch.randint(4, 96, (3, 4), generator=g)
    valid = torch.tensor([3, 4, 1])
    out = model(block, 6 + _positions(3, 4), cache=cache, rows=rows, valid=valid)
    for i in range(3):
        n = int(valid[i])
        full = torch.cat([prompt[i], block[i, :n]])[None]
        ref = model(full, _positions(1, 6 + n)).logits[0, 6:]
        _close(out.logits[i, :n], ref)
    assert cache.lengths.tolist() == (6 + valid).tolist()


@needs_bf16_gemm
@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_verify_is_the_padded_verify_on_every_real_token(tiny_target_dir, family):
    """A verify whose rows check different numbers of tokens runs packed (`Packing`: the projections
    on the real tokens only, the padding's queries skipped in attention): in bf16-gemm each real
    token's logits and captured features are the padded forward's to the bit, the padding's are
    zeros, and the cache advances by `valid`."""
    from lilicorr.target import Packing
    model = load_target(tiny_target_dir(family), dtype="bf16-gemm")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, 96, (3, 6), generator=g)
    block = torch.randint(4, 96, (3, 4), generator=g)
    valid = torch.tensor([1, 4, 2])
    outs = []
    for v in (None, valid):
        cache = model.new_cache(num_slots=3, capacity=16)
        rows = torch.tensor([cache.allocate() for _ in range(3)])
        model(prompt, _positions(3, 6), cache=cache, rows=rows, valid=torch.tensor([6, 3, 5]))
        outs.append(model(block, 6 + _positions(3, 4), cache=cache, rows=rows, valid=v, capture=[0, 1]))
        assert cache.lengths.tolist() == (torch.tensor([6, 3, 5]) + (4 if v is None else valid)).tolist()
    padded, packed = outs
    # the argmax is taken on the packed logits (no [N, T, V] unpack): the padded forward's on every
    # real token, 0 at the padding
    assert packed.packing is not None and packed.packed_logits.shape == (1, int(valid.sum()), model.config.vocab_size)
    greedy, want = packed.greedy(), padded.logits.argmax(-1)
    real = torch.arange(4)[None, :] < valid[:, None]
    assert torch.equal(greedy[real], want[real]) and not greedy[~real].any()
    assert torch.equal(padded.greedy(), want)
    for i, n in enumerate(valid.tolist()):
        assert torch.equal(packed.logits[i, :n], padded.logits[i, :n]), (family, i)
        assert torch.equal(packed.captured[i, :n], padded.captured[i, :n]), (family, i)
        assert not packed.logits[i, n:].any() and not packed.captured[i, n:].any()
    assert Packing.of(torch.tensor([4, 4, 4]), 4) is None and Packing.of(valid, 1) is None


@torch.no_grad()
def test_truncate_rollback_then_redecode_equals_fresh_run(tiny_target_dir):
    model = load_target(tiny_target_dir("qwen3"))
    cache = model.new_cache(num_slots=2)
    rows = torch.tensor([cache.allocate(), cache.allocate()])
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(4, 96, (2, 7), generator=g)
    model(prompt, _positions(2, 7), cache=cache, rows=rows)
    drafted = torch.randint(4, 96, (2, 4), generator=g)
    model(drafted, 7 + _positions(2, 4), cache=cache, rows=rows)
    with pytest.raises(ValueError):
        cache.truncate(rows, torch.tensor([7, 12]))       # never grows a row
    cache.truncate(rows, torch.tensor([7, 9]))            # row 0 rejects all 4, row 1 keeps 2
    redo = torch.randint(4, 96, (2, 3), generator=g)
    out = model(redo, cache.lengths[rows][:, None] + _positions(2, 3), cache=cache, rows=rows)
    ref0 = model(torch.cat([prompt[0], redo[0]])[None], _positions(1, 10)).logits[0, 7:]
    ref1 = model(torch.cat([prompt[1], drafted[1, :2], redo[1]])[None], _positions(1, 12)).logits[0, 9:]
    _close(out.logits[0], ref0)
    _close(out.logits[1], ref1)
    assert cache.lengths[rows].tolist() == [10, 12]


@torch.no_grad()
def test_invariant_attention_is_attention():
    """`invariant_attention` computes scaled_dot_product_attention's function: grouped-query heads,
    ragged rows with padded keys, a draft-tree mask, the no-cache causal [T, T] mask, and more
    queries than one GEMM takes (chunks); to float32 rounding in fp32, to bf16 rounding in bf16."""
    import torch.nn.functional as F

    from lilicorr.batch_invariant import ROWS, invariant_attention
    from lilicorr.target import attention_mask
    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d = 2, 6, 2, 16
    start = torch.tensor([7, 3])
    tree = torch.tril(torch.randint(0, 2, (n, 5, 5), generator=g).bool()) | torch.eye(5, dtype=torch.bool)
    cases = [(t, *attention_mask(start, t, torch.float32, "cpu")) for t in (1, 5, ROWS)]
    cases.append((5, *attention_mask(start, 5, torch.float32, "cpu", tree=tree)))
    cases.append((9, *attention_mask(None, 9, torch.float32, "cpu")))
    for t, mask, upto in cases:
        q = torch.randn(n, hq, t, d, generator=g)
        k, v = torch.randn(2, n, hkv, upto, d, generator=g)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        _close(invariant_attention(q, k, v, mask), want)
        q16, k16, v16 = q.bfloat16(), k.bfloat16(), v.bfloat16()
        got16 = invariant_attention(q16, k16, v16, mask.bfloat16())
        want16 = F.scaled_dot_product_attention(q16.float(), k16.float(), v16.float(), attn_mask=mask, enable_gqa=True)
        assert got16.dtype == torch.bfloat16
        assert float((got16.float() - want16).abs().max()) <= 4 * BF16_EPS * float(want16.abs().max()), t


@torch.no_grad()
def test_invariant_attention_reads_float32_cache_blocks_as_they_are():
    """The target's batch-invariant cache is float32 in whole KEY_BLOCKs, read to a whole block
    with a float32 mask: whatever the keys past a row's own hold (stale drafts), the result equals
    the bf16 route that pads with zeros, bit for bit; and the bf16 target's cache is that cache."""
    from lilicorr.batch_invariant import KEY_BLOCK, invariant_attention, padded_keys
    from lilicorr.target import attention_mask
    g = torch.Generator().manual_seed(1)
    n, hq, hkv, d, t = 2, 6, 2, 16, 4
    start = torch.tensor([150, 37])
    mask16, upto = attention_mask(start, t, torch.bfloat16, "cpu")
    width = padded_keys(upto)
    mask32, _ = attention_mask(start, t, torch.float32, "cpu", width=width)
    assert width % KEY_BLOCK == 0 and mask32.shape[-1] == width
    q = torch.randn(n, hq, t, d, generator=g).bfloat16()
    k16, v16 = torch.randn(2, n, hkv, upto, d, generator=g).bfloat16()
    cache_k, cache_v = (torch.randn(n, hkv, width + KEY_BLOCK, d, generator=g) * 1e4 for _ in range(2))
    cache_k[:, :, :upto], cache_v[:, :, :upto] = k16, v16                   # past upto: stale values
    want = invariant_attention(q, k16, v16, mask16)
    got = invariant_attention(q, cache_k[:, :, :width], cache_v[:, :, :width], mask32)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_batch_invariant_target_cache_is_float32_whole_blocks(tiny_target_dir):
    """A bf16 target in batch-invariant mode caches float32 in whole KEY_BLOCKs (a cached forward
    then agrees with the uncached one to bf16 rounding); without the mode it caches bf16."""
    from lilicorr.batch_invariant import KEY_BLOCK
    path = tiny_target_dir("llama")
    plain, invariant = load_target(path, dtype="bfloat16", batch_invariant=False), load_target(path, dtype="bfloat16")
    assert invariant.batch_invariant and plain.new_cache(2, capacity=100).dtype == torch.bfloat16
    cache = invariant.new_cache(2, capacity=100)
    assert cache.dtype == torch.float32 and cache.capacity % KEY_BLOCK == 0
    ids = torch.randint(0, invariant.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([cache.allocate()])
    invariant(ids[:, :6], _positions(1, 6), cache=cache, rows=rows)
    cached = invariant(ids[:, 6:], _positions(1, 9)[:, 6:], cache=cache, rows=rows).logits[0]
    whole = invariant(ids, _positions(1, 9)).logits[0, 6:]
    assert float((cached - whole).abs().max()) <= 4 * BF16_EPS * float(whole.abs().max())


def test_batch_invariance_check_detects_a_batch_dependent_kernel():
    """The check compares each row of an M-row call with that row computed alone: a row-wise
    function passes, one that mixes rows (here: centring over the batch) fails."""
    from lilicorr.batch_invariant import _rows_alone_equal
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    assert _rows_alone_equal(lambda a: a * 2 + 1, x)
    assert not _rows_alone_equal(lambda a: a - a.mean(0, keepdim=True), x)


@torch.no_grad()
def test_fit_single_rows_pads_a_lone_row_only_where_that_restores_invariance():
    """A kernel that rounds a lone row differently from 2..ROWS rows (as oneDNN's bf16 kernel does
    for some shapes on an AVX512-BF16 EPYC; simulated here by a matrix-vector path that sums in a
    different order) gets its lone rows computed as two rows, and then every row equals the row
    alone; a kernel whose rows depend on the other rows at any count stays as it is (the check
    reports it), and so does one that is already invariant."""
    from torch import nn

    from lilicorr.batch_invariant import ROWS, InvariantLinear, _rows_alone_equal, fit_single_rows

    class RowWise(InvariantLinear):       # every row on its own: the same sums at any row count
        def _plain_gemm(self, x):
            return (x[:, None, :] * self.weight[None]).sum(-1) + self.bias

    class GemvDiffers(RowWise):
        def _plain_gemm(self, x):
            if x.shape[0] == 1:           # another summation order for a lone row
                return (x[:, None, :] * self.weight[None]).flip(-1).sum(-1) + self.bias
            return super()._plain_gemm(x)

    class MixesRows(RowWise):
        def _plain_gemm(self, x):
            return super()._plain_gemm(x) + 1e-3 * x.shape[0]

    g = torch.Generator().manual_seed(0)
    lins = [nn.Linear(48, 16), nn.Linear(48, 16), nn.Linear(40, 24), nn.Linear(32, 8)]
    for lin in lins:
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
    model = nn.ModuleList([GemvDiffers(lins[0]), GemvDiffers(lins[1]), MixesRows(lins[2]), RowWise(lins[3])])
    x48 = torch.randn(ROWS, 48, generator=g)
    assert not _rows_alone_equal(model[0], x48)
    assert fit_single_rows(model) == 2
    assert [m.pad_single_row for m in model] == [True, True, False, False]
    assert "a lone row as two" in repr(model[0])
    assert _rows_alone_equal(model[0], x48) and _rows_alone_equal(model[1], x48)
    assert not _rows_alone_equal(model[2], torch.randn(ROWS, 40, generator=g))
    assert _rows_alone_equal(model[3], torch.randn(ROWS, 32, generator=g))
    assert torch.allclose(model[0](x48[:1]), lins[0](x48[:1]), atol=1e-5)


@pytest.mark.parametrize("blocked", [False, True])
@pytest.mark.parametrize("family,overrides", [("llama", {"tie_word_embeddings": True}), ("qwen3", {})])
@torch.no_grad()
def test_bf16_on_cpu_is_batch_invariant(tiny_target_dir, family, overrides, blocked):
    """bf16 on a CPU loads in batch-invariant mode once this machine's kernels pass the check: every
    linear an InvariantLinear on the same parameters (a tied embedding stays tied), attention the
    invariant one: bf16-gemm's compiled kernel where this CPU builds it, else (and after
    `use_blocked_attention`) the blocked GEMMs of `invariant_attention`. Then each token's logits
    are bit-identical whether it is verified in one forward with the rest of its block, next to
    other rows, or decoded one token per forward. Where the check fails the model keeps PyTorch's
    kernels and says so. Other precisions are untouched."""
    import warnings

    from lilicorr.batch_invariant import InvariantLinear
    from lilicorr.bf16_gemm import fused_attention
    from lilicorr.target import use_blocked_attention
    path = tiny_target_dir(family, **overrides)
    assert not load_target(path).batch_invariant and not load_target(path, dtype="fp16-weights").batch_invariant
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_target(path, dtype="bfloat16")
    linears = [m for m in model.modules() if isinstance(m, InvariantLinear)]
    if not model.batch_invariant:
        assert any("not batch-invariant" in str(w.message) for w in caught)
        assert not linears and not model.layers[0].self_attn.invariant_attention
        return
    assert not [w for w in caught if "batch-invariant" in str(w.message)]
    assert len(linears) == 4 * len(model.layers) + 1 and model.layers[0].self_attn.invariant_attention
    assert (model.lm_head.weight is model.embed_tokens.weight) == bool(overrides.get("tie_word_embeddings"))
    kernels = {layer.self_attn.attention_kernel for layer in model.layers}
    assert kernels == ({None} if bf16_gemm_missing() else {fused_attention})
    if blocked:
        use_blocked_attention(model)
        assert {layer.self_attn.attention_kernel for layer in model.layers} == {None}
    with pytest.raises(ValueError, match="batch-invariant bf16"):
        use_blocked_attention(load_target(path))
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(4, model.config.vocab_size, (3, 6), generator=g)
    block = torch.randint(4, model.config.vocab_size, (3, 8), generator=g)
    cache = model.new_cache(num_slots=3, capacity=32)
    rows = torch.tensor([cache.allocate() for _ in range(3)])
    model(prompts, _positions(3, 6), cache=cache, rows=rows, logits=False)
    together = model(block, 6 + _positions(3, 8), cache=cache, rows=rows).logits       # [3, 8, V]
    for i in range(3):
        alone = model.new_cache(num_slots=1, capacity=32)
        r = torch.tensor([alone.allocate()])
        model(prompts[i:i + 1], _positions(1, 6), cache=alone, rows=r, logits=False)
        for j in range(8):
            step = model(block[i:i + 1, j:j + 1], torch.tensor([[6 + j]]), cache=alone, rows=r).logits
            assert torch.equal(step[0, 0], together[i, j]), (i, j)


@torch.no_grad()
def test_bf16_falls_back_to_pytorch_kernels_where_the_check_fails(tiny_target_dir, monkeypatch):
    """A machine whose kernels fail the batch-invariance check (simulated: this one passes) gets
    PyTorch's kernels back, the same logits as batch_invariant=False, and a warning naming it."""
    import lilicorr.batch_invariant as bi
    path = tiny_target_dir("qwen2")
    monkeypatch.setattr(bi, "check_batch_invariant", lambda model: ["linear lm_head [64 -> 96]"])
    with pytest.warns(RuntimeWarning, match=r"not batch-invariant \(linear lm_head"):
        model = load_target(path, dtype="bfloat16")
    assert not model.batch_invariant
    assert not any(isinstance(m, bi.InvariantLinear) for m in model.modules())
    assert not any(getattr(m, "invariant_attention", False) for m in model.modules())
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    plain = load_target(path, dtype="bfloat16", batch_invariant=False)
    assert torch.equal(model(ids, _positions(2, 7)).logits, plain(ids, _positions(2, 7)).logits)


def test_bf16_linears_are_prepacked_where_onednn_has_it(tiny_target_dir, monkeypatch):
    """bf16 linears in batch-invariant mode keep a oneDNN-prepacked copy of the weight: the same
    function as F.linear on that weight (bf16 rounding apart), every row as if alone (the load-time
    check), and an input that needs a gradient takes F.linear, so gradients reach it. Where only the
    prepacked kernel fails the check, the linears drop it and the mode stays on."""
    import torch.nn.functional as F

    import lilicorr.batch_invariant as bi
    if bi.pack_bf16(torch.zeros(2, 2, dtype=torch.bfloat16)) is None:
        pytest.skip("this PyTorch build has no oneDNN linear")
    path = tiny_target_dir("llama", tie_word_embeddings=True)
    model = load_target(path, dtype="bfloat16")
    if not model.batch_invariant:
        pytest.skip("this machine's bf16 kernels are not batch-invariant (load_target warned)")
    linears = [m for m in model.modules() if isinstance(m, bi.InvariantLinear)]
    assert linears and all(m._packed is not None for m in linears)
    assert "prepacked" in repr(model.lm_head) and model.lm_head.weight is model.embed_tokens.weight
    assert "_packed" not in str(list(model.state_dict()))
    g = torch.Generator().manual_seed(0)
    for m in linears:
        x = torch.randn(3, 5, m.in_features, generator=g).bfloat16()
        with torch.no_grad():
            got, want = m(x), F.linear(x, m.weight, m.bias)
        assert got.shape == want.shape == (3, 5, m.out_features)
        assert float((got.float() - want.float()).abs().max()) <= 2 * BF16_EPS * float(want.float().abs().max())
    x = torch.randn(4, model.lm_head.in_features, generator=g).bfloat16().requires_grad_()
    model.lm_head(x).float().sum().backward()
    want = model.lm_head.weight.float().sum(0)
    assert float((x.grad.float() - want).abs().max()) <= 2 * BF16_EPS * float(want.abs().max())

    real = bi.check_batch_invariant

    def packed_fails(m):       # a machine whose prepacked kernel is not batch-invariant (simulated)
        packed = any(x._packed is not None for x in m.modules() if isinstance(x, bi.InvariantLinear))
        return ["linear lm_head [64 -> 96]"] if packed else real(m)

    monkeypatch.setattr(bi, "check_batch_invariant", packed_fails)
    model = load_target(path, dtype="bfloat16")
    assert model.batch_invariant
    assert all(m._packed is None for m in model.modules() if isinstance(m, bi.InvariantLinear))


def test_kv_cache_takes_the_lowest_free_slot():
    """Freed slots are reused lowest first, so running rows stay packed at slots 0..N-1 (their
    reads are views)."""
    c = KVCache(1, 6, 1, 4, capacity=4)
    slots = [c.allocate() for _ in range(5)]
    assert slots == [0, 1, 2, 3, 4]
    c.free(3)
    c.free(1)
    assert c.allocate() == 1 and c.allocate() == 3 and c.allocate() == 5
    assert isinstance(KVCache.row_index(torch.tensor([0, 1, 2, 3, 4])), slice)


def test_kv_cache_write_plan_writes_what_write_does():
    """A forward's write plan (computed once for all layers) stores exactly what a plain write
    stores: scattered rows, ragged starts, a `valid` cut; a plan made before the cache grew is refused."""
    g = torch.Generator().manual_seed(0)
    a, b = (KVCache(2, 5, 3, 4, capacity=16) for _ in range(2))
    rows, start = torch.tensor([3, 0, 2]), torch.tensor([4, 0, 9])
    valid = torch.tensor([5, 2, 0])
    k, v = torch.randn(2, 3, 5, 3, 4, generator=g)
    for layer in range(2):
        a.write(layer, rows, k, v, start, valid)
    plan = b.write_plan(rows, start, 5, valid)
    for layer in range(2):
        b.write(layer, rows, k, v, plan=plan)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and bool(b.k.abs().sum() > 0)
    whole = b.write_plan(KVCache.row_index(torch.tensor([1, 2])), torch.tensor([0, 3]), 2)
    b.write(1, slice(1, 3), k[:2, :2], v[:2, :2], plan=whole)
    assert torch.equal(b.k[1, 2, :, 3:5], k[1, :2].transpose(0, 1))
    b.reserve(torch.tensor([0]), 40)
    with pytest.raises(RuntimeError, match="grew"):
        b.write(0, rows, k, v, plan=plan)


def test_kv_cache_pool_and_errors():
    c = KVCache(2, 2, 1, 4, capacity=2)
    a, b = c.allocate(), c.allocate()
    assert (a, b) == (0, 1) and c.num_free == 0
    with pytest.raises(RuntimeError):
        c.allocate()
    c.free(a)
    with pytest.raises(ValueError):
        c.free(a)
    k = torch.randn(1, 5, 1, 4)
    c.write(1, torch.tensor([b]), k, k + 1)
    c.advance(torch.tensor([b]), 5)
    assert c.capacity == 8
    rk, rv = c.read(1, torch.tensor([b]), 5)
    assert torch.equal(rk, k.transpose(1, 2)) and torch.equal(rv, (k + 1).transpose(1, 2))
    assert KVCache.row_index(torch.tensor([1])) == slice(1, 2)
    ones = torch.ones(1, 3, 1, 4)
    c.write(0, slice(1, 2), ones, ones, valid=torch.tensor([2]))   # at lengths[1] = 5; only 2 tokens
    assert torch.count_nonzero(c.k[0, 1]) == 2 * 4 and torch.count_nonzero(c.k[0, 1, :, 5:7]) == 2 * 4
    with pytest.raises(ValueError):
        KVCache(0, 1, 1, 1)


@torch.no_grad()
def test_yarn_and_llama3_rope_match_transformers():
    pos = torch.arange(0, 300, 7)[None]
    for scaling in ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                    {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64, "beta_fast": 16,
                     "beta_slow": 2},
                    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}):
        cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=256,
                                       rope_theta=10000.0, rope_scaling=dict(scaling))
        ref = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
        rc, rs = ref(torch.zeros(1, 1, 32), pos)
        ours = RotaryEmbedding(32, 10000.0, scaling, 256)
        c, s = ours(pos, torch.float32)
        torch.testing.assert_close(c, rc, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=1e-6)
    assert ours.attention_scaling == 1.0


@torch.no_grad()
def test_yarn_model_matches_transformers_and_with_yarn(tiny_target_dir):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path = tiny_target_dir("qwen2", rope_scaling=yarn)
    ours, ref = load_target(path), _hf(path)
    assert ours.config.rope_scaling["rope_type"] == "yarn"
    assert abs(ours.rotary.attention_scaling - (0.1 * torch.log(torch.tensor(4.0)).item() + 1)) < 1e-6
    ids = torch.randint(0, 96, (1, 60), generator=torch.Generator().manual_seed(5))
    _close(ours(ids, _positions(1, 60)).logits, ref(ids).logits)
    # switching YaRN on at inference over the plain model gives the same tables
    plain = load_target(tiny_target_dir("qwen2"))
    plain.enable_yarn(4.0, original_max=32)
    assert plain.config.rope_scaling == with_yarn(TargetConfig(max_position_embeddings=32), 4.0).rope_scaling
    torch.testing.assert_close(plain.rotary.inv_freq, ours.rotary.inv_freq)
    assert load_target(tiny_target_dir("qwen2"), yarn_factor=2.0).config.max_position_embeddings == 256


def test_bad_inputs_give_clear_errors(tmp_path, tiny_target_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        TargetConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8}))
    with pytest.raises(ValueError, match="unsupported target model_type 'gpt2'"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text((tiny_target_dir("llama") / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_target(tmp_path)
    model = load_target(tiny_target_dir("llama"))
    with pytest.raises(ValueError, match="capture"):
        model(torch.zeros(1, 2, dtype=torch.long), _positions(1, 2), capture=(7,))
    with pytest.raises(ValueError, match="rows"):
        model(torch.zeros(1, 2, dtype=torch.long), _positions(1, 2), cache=model.new_cache(1))


# ---------------------------------------------------------------------- real SmolLM2 (slow)
@pytest.mark.slow
@torch.no_grad()
def test_smollm2_logits_and_greedy_match_transformers(smollm2_dir):
    from lilicorr.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France? Answer briefly."}])
    ours, ref = load_target(smollm2_dir), _hf(smollm2_dir)
    assert ours.config.num_hidden_layers == 30 and ours.config.tie_word_embeddings
    x = torch.tensor([ids])
    out = ours(x, _positions(1, len(ids)), capture=(1, 14, 27))
    r = ref(x, output_hidden_states=True)
    _close(out.logits, r.logits, rel=1e-4)
    for i, k in enumerate((1, 14, 27)):
        _close(out.captured[:, :, i], r.hidden_states[k + 1], rel=1e-4)

    gen = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                       eos_token_id=None, pad_token_id=tok.pad_id)[0, len(ids):].tolist()
    cache = ours.new_cache(num_slots=1, capacity=32)
    rows = torch.tensor([cache.allocate()])
    lg = ours(x, _positions(1, len(ids)), cache=cache, rows=rows).logits[:, -1]
    mine = []
    for _ in range(16):
        nxt = lg.argmax(-1)
        mine.append(int(nxt))
        lg = ours(nxt[:, None], cache.lengths[rows][:, None], cache=cache, rows=rows).logits[:, -1]
    assert mine == gen, (tok.decode(mine), tok.decode(gen))


def test_prepare_target_refuses_foreign_folder(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "train" / "prepare_target.py"
    (tmp_path / "notes.txt").write_text("not a target")
    proc = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "not a folder made by this script" in proc.stderr
    assert (tmp_path / "notes.txt").is_file()


@torch.no_grad()
def test_sharded_checkpoint_loads(tiny_target_dir, tmp_path):
    path = tiny_target_dir("qwen3")
    _hf(path).save_pretrained(str(tmp_path), max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(6))
    a = load_target(tmp_path)(ids, _positions(1, 6)).logits
    assert torch.equal(a, load_target(path)(ids, _positions(1, 6)).logits)


def test_auto_on_amx_falls_back_where_bf16_kernels_fail(tiny_target_dir, monkeypatch):
    """auto on an AMX CPU loads bf16, batch-invariant (lossless). On a machine whose bf16 kernels
    fail the batch-invariance check (made to fail here: the check's verdict is the only thing
    replaced), auto goes down its order with a warning per step instead of serving a lossy target:
    past bf16 and (where this CPU has it) bf16-gemm, which needs the same check, to the first
    precision that needs none; bf16 asked for by name keeps PyTorch's kernels and warns, as before."""
    import lilicorr.batch_invariant as bi
    import lilicorr.target as tg
    path = tiny_target_dir("llama")
    monkeypatch.setattr(tg, "cpu_has_amx_bf16", lambda: True)
    model = load_target(path, dtype="auto")
    if model.precision == "bfloat16":           # this machine's kernels passed the real check
        assert model.batch_invariant
    monkeypatch.setattr(bi, "check_batch_invariant", lambda m: ["linear: rows differ (forced)"])
    with pytest.warns(RuntimeWarning, match="dtype auto serves") as warned:
        model = load_target(path, dtype="auto")
    unchecked = [p for p in tg._cpu_fallbacks() if p not in tg.BATCH_INVARIANT_PRECISIONS]
    assert model.precision == unchecked[0] and not model.batch_invariant
    steps = [str(w.message) for w in warned if "dtype auto serves" in str(w.message)]
    assert len(steps) == 1 + ("bf16-gemm" in tg._cpu_fallbacks()), steps
    with pytest.warns(RuntimeWarning, match="not batch-invariant"):
        named = load_target(path, dtype="bfloat16")
    assert named.precision == "bfloat16" and not named.batch_invariant
