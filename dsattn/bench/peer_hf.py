"""A peer to benchmark against: Hugging Face transformers' DeepseekV4 (PyTorch, CPU, float32)
shaped like one of our V4 presets.

    why = available()                  # None, or why the peer cannot run
    model, notes = build(cfg)          # DeepseekV4ForCausalLM in eval mode; notes: what differs
    time_decode(model, 4096, batch=1)  # {"step_ms", "fill_s", "method", ...}
    time_forward(model, 1024)          # seconds for one teacher-forced forward

Needs the optional ``peer`` extra (torch and transformers >= 5.24, which ships DeepseekV4);
torch is imported inside the functions, so dsattn itself never needs it. Thread count is
left to the caller (``torch.set_num_threads``).

How the peer runs (read from transformers 5.24, ``models/deepseek_v4``): eager attention
only; one shared K=V entry per token for all heads; a sliding-window cache layer per layer
(``W - 1`` past tokens plus the current one); CSA/HCA layers keep their compressor's open
span, its emitted entries and (CSA) the overlap half in their cache layer. Its CSA scores
every causal compressed entry with the indexer, takes ``torch.topk`` and turns the picks into
a dense ``-inf``/0 bias over *all* compressed entries: attention still multiplies against
every entry (a mask, not a gather), so a decode step is O(context / m) per CSA layer in
attention as well as in scoring. A teacher-forced forward builds dense [T, T] window masks,
so it is quadratic in time and memory; ``time_decode`` therefore builds its context by
chunked prefill through the model's own cache, which reproduces the full forward (see
tests/test_peer_hf.py).
"""

from __future__ import annotations

import math
import statistics
import time

from dsattn.cache import formats

INSTALL_HINT = "pip install -e '.[peer]'  (torch and transformers>=5.24 with DeepseekV4)"

# our layer kind -> transformers' layer type
_LAYER_TYPE = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
               "hca": "heavily_compressed_attention"}


def available() -> str | None:
    """None when torch and transformers with DeepseekV4 import, else the reason."""
    try:
        import torch  # noqa: F401
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: F401
    except Exception as e:  # ImportError, or a broken install raising something else
        return f"{type(e).__name__}: {e}; install the peer extra: {INSTALL_HINT}"
    return None


def _require():
    why = available()
    if why:
        raise ImportError(why)


def hf_config(cfg, *, hc_mult: int = 1):
    """The DeepseekV4Config closest to our `cfg` (V4 kinds swa/csa/hca only).

    Raises ValueError for what it cannot express at all: another layer kind, or two layers of
    one kind with different compression ratios (its ratios are per layer *type*).
    """
    _require()
    from transformers import DeepseekV4Config

    a, m, ix = cfg.attention, cfg.model, cfg.indexer
    kinds = cfg.attention.layers
    bad = sorted(set(kinds) - set(_LAYER_TYPE))
    if bad:
        raise ValueError(f"attention.layers: the HF DeepseekV4 peer has only swa/csa/hca "
                         f"layers; cannot build {', '.join(bad)}")
    rates = {}
    for i, (k, r) in enumerate(zip(kinds, a.ratios)):
        if not r:  # uncompressed (sliding window only)
            continue
        if rates.setdefault(k, r) != r:
            raise ValueError(f"attention.ratios: HF DeepseekV4 has one compression ratio per "
                             f"layer type; {k} layers use both {rates[k]} and {r} (layer {i})")
    if a.rope_dim >= a.entry_dim or a.rope_dim % 2:
        raise ValueError(f"attention.rope_dim={a.rope_dim}: needs an even value < entry_dim")
    n = len(kinds)
    return DeepseekV4Config(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        num_hidden_layers=n,
        layer_types=[_LAYER_TYPE[k] for k in kinds],
        compress_rates={"compressed_sparse_attention": rates.get("csa", a.csa_ratio),
                        "heavily_compressed_attention": rates.get("hca", a.hca_ratio)},
        num_attention_heads=a.n_heads,
        num_key_value_heads=1,
        head_dim=a.entry_dim,
        partial_rotary_factor=a.rope_dim / a.entry_dim,
        q_lora_rank=a.q_lora_rank,
        o_groups=a.o_groups,
        o_lora_rank=a.o_lora_rank,
        sliding_window=a.window,
        rope_theta=float(a.rope_theta),
        compress_rope_theta=float(a.compress_rope_theta),
        index_n_heads=ix.n_heads,
        index_head_dim=ix.head_dim,
        index_topk=a.top_k,
        # FFN: no routed experts, so the MoE block is its shared expert alone, a SwiGLU of
        # our width; an infinite clamp makes that SwiGLU exact.
        n_routed_experts=0,
        num_experts_per_tok=0,
        n_shared_experts=1,
        moe_intermediate_size=m.ffn_hidden,
        mlp_layer_types=["moe"] * n,
        swiglu_limit=float("inf"),
        hc_mult=hc_mult,
        hc_sinkhorn_iters=1 if hc_mult == 1 else 20,
        rms_norm_eps=m.norm_eps,
        initializer_range=m.init_std,
        tie_word_embeddings=m.tie_embeddings,
        num_nextn_predict_layers=0,
        # grouped_mm cannot dispatch over zero experts; eager is V4's only attention.
        experts_implementation="eager",
        attn_implementation="eager",
    )


def build(cfg, seed: int = 0, *, hc_mult: int = 1):
    """(DeepseekV4ForCausalLM in eval mode, float32, CPU; notes on what does not match).

    Same width, depth, per-layer kind and ratios, window, top-k, heads and head dims, q/o
    low-rank sizes and indexer shape as `cfg`. `hc_mult=1` keeps the residual one stream wide
    like ours; pass 4 for V4's real mHC. Weights are random (seeded; torch's global RNG is
    left as it was).
    """
    _require()
    import torch
    from transformers import DeepseekV4ForCausalLM

    hf = hf_config(cfg, hc_mult=hc_mult)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM(hf)
    model = model.to(dtype=torch.float32).eval()
    return model, _notes(cfg, hf, model)


def _notes(cfg, hf, model) -> list[str]:
    a, ix, c = cfg.attention, cfg.indexer, cfg.cache
    notes = [
        f"FFN: its MoE block with 0 routed experts, i.e. the shared expert alone, a SwiGLU "
        f"{hf.hidden_size}->{hf.moe_intermediate_size}->{hf.hidden_size} like ours (clamp "
        f"limit set to inf); it still runs an empty router (a [0, d_model] matmul, top-0, "
        f"one_hot) per layer. V4 itself has 256 routed experts, top-6, plus hash routing in "
        f"the first 3 layers",
        (f"mHC: hyper-connections with hc_mult=1 (one stream, as wide as our residual) and "
         f"one Sinkhorn step, so each sublayer computes pre/post/comb gates from the residual "
         f"(x <- comb*x + post*f(pre*x); at init comb~1, pre~0.5 which the block's RMSNorm "
         f"cancels, post~1+-0.1: close to our x + f(x) but not equal), plus the final "
         f"hc_head collapse" if hf.hc_mult == 1 else
         f"mHC: hyper-connections with hc_mult={hf.hc_mult} streams and "
         f"{hf.hc_sinkhorn_iters} Sinkhorn steps per sublayer; ours is a plain residual"),
        "top-k: its indexer scores every causal compressed entry, takes torch.topk and masks "
        "(-inf bias) over ALL compressed entries, so attention still reads every entry; ours "
        "gathers the selected entries. Ties (ReLU zeros) break arbitrarily in torch.topk, "
        "toward the lowest index in ours",
        "attention: eager PyTorch only (no SDPA/flash: the sink logit); a teacher-forced "
        "forward builds dense [T, T] window masks, so it is quadratic in time and memory",
        "cache: float32 tensors grown by torch.cat (sliding window W-1 tokens, compressed "
        "entries appended); ours is a ring buffer plus a paged cache"
        + (f" in formats local={c.local_format} main={c.main_format} key={c.key_format}"
           if not all(formats.spec(f).exact for f in (c.local_format, c.main_format,
                                                       c.key_format)) else ""),
        "weights: random init (transformers' initializer, std "
        f"{hf.initializer_range}); not our parameters, so logits differ",
    ]
    if cfg.model.dtype != "float32":
        notes.append(f"dtype: float32 (cfg has model.dtype={cfg.model.dtype})")
    if ix.rope_dim != a.rope_dim:
        notes.append(f"indexer RoPE: it rotates the last {a.rope_dim} dims (the attention's "
                     f"rope dim) of its queries and keys; ours {ix.rope_dim}")
    if not a.query_norm:
        notes.append("query norm: it always RMS-normalises each head's query; cfg has "
                     "attention.query_norm=false")
    if not cfg.model.tie_embeddings:
        notes.append("embeddings untied in both")
    if a.pool_blocks:
        notes.append("hierarchical indexer (attention.pool_blocks) has no counterpart: it "
                     "scores every entry")
    ours = _our_param_count(cfg)
    theirs = sum(p.numel() for p in model.parameters())
    notes.append(f"parameters: {theirs:,} (HF peer) vs "
                 + (f"{ours:,} (ours)" if isinstance(ours, int) else f"ours unknown ({ours})"))
    return notes


def _our_param_count(cfg):
    """Our Transformer's parameter count from abstract shapes (no arrays are built)."""
    try:
        from flax import nnx

        from dsattn.model import Transformer

        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        leaves = __import__("jax").tree.leaves(nnx.state(abstract, nnx.Param))
        return int(sum(math.prod(x.shape) for x in leaves))
    except Exception as e:  # optional: a note, never a failure of build
        return f"{type(e).__name__}: {e}"


def _tokens(model, batch: int, n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, n), generator=g)


def time_decode(model, context: int, batch: int, steps: int = 8, warmup: int = 2, *,
                chunk: int = 512, seed: int = 0) -> dict:
    """Median ms per decode step (one new token per row) after `context` tokens of context.

    The context (random tokens) is built by chunked prefill: `chunk` tokens per call through
    one `DynamicCache(config=...)`, which holds V4's own cache layers (window K=V, compressor
    buffers, emitted entries, CSA overlap state). Each step then runs
    ``model(input_ids=[B, 1], cache=cache, use_cache=True, logits_to_keep=1)`` and a greedy
    argmax, as `generate`'s loop does, under torch.inference_mode; `warmup` steps first.
    Also returns "step_cpu_ms" (median process CPU time per step: on a shared machine, with
    one torch thread, closer to the work than wall time), "cache_tokens" and "threads".
    """
    _require()
    import torch
    from transformers import DynamicCache

    if context < 1 or batch < 1 or steps < 1 or chunk < 1:
        raise ValueError(f"time_decode: context, batch, steps and chunk must be >= 1; got "
                         f"{context}, {batch}, {steps}, {chunk}")
    ids = _tokens(model, batch, context, seed)
    with torch.inference_mode():
        _warm(model, batch)
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        for s in range(0, context, chunk):
            out = model(input_ids=ids[:, s:s + chunk], cache=cache, use_cache=True,
                        logits_to_keep=1)
        fill_s = time.perf_counter() - t0
        held = cache.get_seq_length()
        if held != context:
            raise RuntimeError(f"time_decode: cache holds {held} tokens after filling "
                               f"{context}")
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        times, cpu = [], []
        for i in range(warmup + steps):
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(input_ids=tok, cache=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
    n_calls = -(-context // chunk)
    return {
        "step_ms": statistics.median(times) * 1e3,
        "step_cpu_ms": statistics.median(cpu) * 1e3,  # process CPU time, all threads
        "fill_s": fill_s,
        "method": (f"context by chunked prefill ({n_calls} call(s) of <= {chunk} tokens) "
                   f"through DynamicCache(config) with V4's cache layers; each step "
                   f"model(input_ids=[{batch}, 1], cache=..., use_cache=True, "
                   f"logits_to_keep=1) + greedy argmax under torch.inference_mode; median "
                   f"of {steps} after {warmup} warm-up; float32, "
                   f"{torch.get_num_threads()} torch threads"),
        "cache_tokens": held,
        "threads": torch.get_num_threads(),
    }


def _warm(model, batch: int, n: int = 32):
    """One small cached forward and decode step so one-time costs stay out of the timings."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = _tokens(model, batch, n + 1, seed=12345)
    model(input_ids=ids[:, :n], cache=cache, use_cache=True, logits_to_keep=1)
    model(input_ids=ids[:, n:], cache=cache, use_cache=True, logits_to_keep=1)


def forward_bytes(model, n_tokens: int, batch: int = 1) -> int:
    """Rough peak bytes of one teacher-forced forward: its eager attention holds about three
    float32 [B, H, T, T + T/m] score tensors (scores, with the sink, softmax) plus the dense
    mask, in the widest layer (m: the smallest compression ratio; window-only: T keys)."""
    c = model.config
    extra = 0
    if any(t != "sliding_attention" for t in c.layer_types):
        m = min(c.compress_rates[t] for t in set(c.layer_types) if t != "sliding_attention")
        extra = n_tokens // m
    keys = n_tokens + extra
    return 4 * batch * n_tokens * keys * (3 * c.num_attention_heads + 2)


def time_forward(model, n_tokens: int, batch: int = 1, repeats: int = 1, *,
                 max_bytes: int = 8 << 30, seed: int = 0) -> float:
    """Seconds for one teacher-forced forward (``use_cache=False``, logits at every position)
    over `n_tokens` random tokens: median of `repeats`, after one warm-up forward of
    min(64, n_tokens) tokens. Raises MemoryError instead of running when `forward_bytes`
    exceeds `max_bytes` (dense masks: 16K tokens needs ~20 GB at the tiny width)."""
    _require()
    import torch

    if n_tokens < 1 or batch < 1 or repeats < 1:
        raise ValueError(f"time_forward: n_tokens, batch and repeats must be >= 1; got "
                         f"{n_tokens}, {batch}, {repeats}")
    need = forward_bytes(model, n_tokens, batch)
    if need > max_bytes:
        raise MemoryError(f"time_forward: a {n_tokens}-token forward (batch {batch}) needs "
                          f"~{need / 2**30:.1f} GiB of dense attention scores and masks; "
                          f"max_bytes is {max_bytes / 2**30:.1f} GiB")
    ids = _tokens(model, batch, n_tokens, seed)
    times = []
    with torch.inference_mode():
        model(input_ids=ids[:, :min(64, n_tokens)], use_cache=False)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
