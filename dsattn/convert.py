"""Start a run from another run's weights under another attention design
(scripts/train.py CONFIG --init-from RUN_DIR[:STEP]; docs/conversion.md).

The new config's model is built, and layer i takes source layer i's weights: every parameter
whose path and shape match is copied (embeddings, norms, FFNs, and attention of the same
family). Where a layer's attention changes family a conversion rule (`RULES`) derives what
it can from the source layer's weights and its calibration activations (the layer's
attention inputs on training text), and names what starts fresh (indexers, compressors,
sinks). Anything else that differs is refused in one line naming the parameter.

The rules:
- MHA/GQA -> MLA (`mha_to_mla`): MHA2MLA's partial RoPE with uniform frequency sampling
  (keep every s-th rotary pair of the source; those are exactly MLA's rotary frequencies),
  one shared rotary key fitted per frequency pair over the heads (the queries absorbing each
  head's rotation and scale of it), and the non-rotary keys and the values factored
  jointly to `kv_lora_rank` by an SVD of their activations.
- MLA -> DSA: everything copied, the indexer fresh (equal to MLA while top-k covers all).
- MHA -> DSA: both of the above.
- MLA/DSA -> the V4 family (`mla_to_v4`): MLA's absorbed form is a V4 layer's window read:
  the latent [C^KV | K^R] is the entry, W^UK folds into the queries, W^UV and W^O into the
  grouped low-rank output (an SVD per group). MHA -> V4 goes through a virtual MLA.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import checkpoint, plan, scan, trainstep
from dsattn.config import Config
from dsattn.errors import ConfigError
from dsattn.plan import Family


class How(enum.Enum):
    COPIED = "copied"
    DERIVED = "derived"
    NEW = "new"


@dataclasses.dataclass(frozen=True)
class Row:
    """One parameter of the new model and where its value came from."""
    where: str  # "embedding", "layer 2", "final norm"
    path: str  # inside `where`
    how: How
    rule: str = ""  # the rule that derived it


@dataclasses.dataclass
class Conversion:
    """The new model's parameters (`params`, laid out as the config's model) and how each
    was made (`rows`); `notes`: what each rule measured; `kl`: KL(source || converted) in
    nats per token on held-out text, before any training (None: not measured)."""
    params: dict
    rows: list
    notes: list
    source: str
    step: int
    layers: list  # per layer: "mha -> mla" or "mla"
    kl: float | None = None

    def counts(self) -> dict:
        return {h: sum(r.how is h for r in self.rows) for h in How}

    def table(self) -> str:
        """What was copied, derived and new, layer by layer, and what the rules measured."""
        lines = [f"initialised from {self.source} (step {self.step}):"]
        for where in dict.fromkeys(r.where for r in self.rows):
            rows = [r for r in self.rows if r.where == where]
            head = where if not where.startswith("layer") else (
                f"{where} ({self.layers[int(where.split()[1])]})")
            parts = []
            for how in How:
                names = [_short(r.path) for r in rows if r.how is how]
                if names:
                    rule = {r.rule for r in rows if r.how is how and r.rule}
                    by = f" by {', '.join(sorted(rule))}" if rule else ""
                    parts.append(f"{how.value}{by}: {', '.join(names)}")
            lines.append(f"  {head}: " + "; ".join(parts))
        lines += [f"  {n}" for n in self.notes]
        c = self.counts()
        lines.append(f"  {c[How.COPIED]} parameters copied, {c[How.DERIVED]} derived, "
                     f"{c[How.NEW]} new")
        if self.kl is not None:
            lines.append(f"  KL(source || converted) on held-out text, before training: "
                         f"{self.kl:.4g} nats/token")
        return "\n".join(lines)


def _short(path: str) -> str:
    """A parameter path without its leaf's name when that says nothing (kernel, weight)."""
    for leaf in ("/kernel", "/weight"):
        if path.endswith(leaf):
            return path[: -len(leaf)]
    return path


def parse_source(text: str) -> tuple[Path, int | None]:
    """RUN_DIR[:STEP] -> (run directory, step or None: its latest)."""
    head, sep, tail = text.rpartition(":")
    if sep and tail.isdigit():
        return Path(head), int(tail)
    return Path(text), None


# ------------------------------------------------------------------------------- trees
def flat(tree) -> dict:
    """A pure dict of parameters as {"a/b/c": array} (the paths train.freeze matches)."""
    return dict(zip(trainstep.parameter_paths(tree), jax.tree.leaves(tree)))


def nested(flat_tree: dict, like: dict) -> dict:
    """`flat`'s inverse, with `like`'s keys (ints stay ints)."""
    def build(node, prefix):
        return {k: build(v, f"{prefix}{k}/") if isinstance(v, dict) else flat_tree[f"{prefix}{k}"]
                for k, v in node.items()}
    return build(like, "")


def per_layer(cfg: Config, params: dict) -> list[dict]:
    """The stack's parameters one dict per layer, in stack order (scanned groups unstacked)."""
    return scan.block_layers(scan.units(cfg), params["blocks"])


def with_layers(cfg: Config, params: dict, layers: list[dict]) -> dict:
    """`params` holding `layers` (one per layer, as `per_layer` gives them)."""
    return {**params, "blocks": scan.layer_blocks(scan.units(cfg), layers)}


# ------------------------------------------------------------------------------- rules
@dataclasses.dataclass(frozen=True)
class Layer:
    """What a rule sees of one layer: the source layer's attention parameters and config,
    the new layer's fresh ones and config, and the calibration activations (the layer's
    attention inputs [N, D], float64; None when not measured)."""
    src: dict
    new: dict
    src_cfg: Config
    cfg: Config
    x: np.ndarray | None
    index: int


@dataclasses.dataclass
class Derived:
    """A rule's output: derived values by path, the paths that start fresh, and notes."""
    values: dict
    fresh: set
    notes: list


def _np(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def _refuse(layer: Layer, why: str):
    raise ConfigError(f"--init-from: layer {layer.index}: {why}")


def _require(layer: Layer, rule: str, why: str, wants: dict):
    """Refuse the layer unless every {key: (this config's value, the value needed)} agrees."""
    for key, (have, need) in wants.items():
        if have != need:
            _refuse(layer, f"{rule} needs {key} = {need} ({why}), got {have}")


def _factor(w: np.ndarray, x: np.ndarray | None, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(A [d, rank], B [rank, n]) with x A B as close as a rank-`rank` product gets to x w
    (an SVD of the activations x w; of w itself without x): B's rows are the top right
    singular vectors, A = w B^T."""
    y = w if x is None else x @ w
    vt = np.linalg.svd(y, full_matrices=False)[2]
    b = vt[:rank]
    if b.shape[0] < rank:  # more rank than the product has: pad with zero directions
        b = np.concatenate([b, np.zeros((rank - b.shape[0], b.shape[1]))])
    return w @ b.T, b


def _relative_error(x: np.ndarray | None, w: np.ndarray, w_hat: np.ndarray) -> float:
    """||x w - x w_hat|| / ||x w|| (on the weights when x is None)."""
    y, y_hat = (w, w_hat) if x is None else (x @ w, x @ w_hat)
    return float(np.linalg.norm(y - y_hat) / max(np.linalg.norm(y), 1e-30))


def _norm_gain(e: np.ndarray, target: np.ndarray, eps: float) -> np.ndarray:
    """Per-channel gain g minimising ||RMSNorm(e) * g - target|| (least squares)."""
    e_hat = e / np.sqrt(np.mean(e * e, axis=-1, keepdims=True) + eps)
    return np.sum(e_hat * target, 0) / np.maximum(np.sum(e_hat * e_hat, 0), 1e-30)


def mha_to_mla(layer: Layer) -> Derived:
    """MHA/GQA -> MLA (module docstring). Exact when the source's rotary pairs all map
    (mha_rope_dim == qk_rope_dim), its heads' kept rotary keys differ per frequency pair
    by a rotation and a scale at most (`_shared_rotary_key`), its
    non-rotary keys and values have rank <= kv_lora_rank, and the new MLA has no latent
    norm (attention.latent_norm=false); otherwise as close as the SVD gets."""
    sa, a, m = layer.src_cfg.attention, layer.cfg.attention, layer.cfg.model
    h, hd = sa.n_heads, sa.head_dim
    g = sa.n_kv_heads or h
    r_src = sa.mha_rope_dim or hd
    dn, dr, dv, dc = a.qk_nope_dim, a.qk_rope_dim, a.v_head_dim, a.kv_lora_rank
    wants = {"attention.n_heads": (a.n_heads, h), "attention.v_head_dim": (dv, hd),
             "attention.qk_nope_dim + qk_rope_dim": (dn + dr, hd),
             "attention.q_lora_rank": (a.q_lora_rank, 0),
             "attention.rope_theta": (a.rope_theta, sa.rope_theta),
             "attention.rope_scaling": (a.rope_scaling, sa.rope_scaling)}
    _require(layer, "mha -> mla", "the source's head", wants)
    if r_src % dr:
        _refuse(layer, f"mha -> mla keeps every s-th of the source's {r_src // 2} rotary "
                       f"pairs: attention.qk_rope_dim={dr} must divide {r_src}")
    s = r_src // dr
    base = hd - r_src  # the rotary dims are the head's last r_src
    kept = np.array([base + 2 * s * j + t for j in range(dr // 2) for t in (0, 1)])
    nope = np.array([i for i in range(hd) if i not in set(kept)])
    src = {k: _np(v) for k, v in layer.src.items()}
    wq, wk, wv = (src[f"{n}/kernel"] for n in ("wq", "wk", "wv"))
    d = wq.shape[0]
    wq = wq.reshape(d, h, hd)
    per_head = lambda w: np.repeat(w.reshape(d, g, hd), h // g, axis=1)  # noqa: E731
    wk, wv = per_head(wk), per_head(wv)
    k_rope = wk[..., kept]  # [d, H, dr]
    w_kr, q_rope, k_hat = _shared_rotary_key(k_rope, wq[..., kept], layer.x)
    wq_b = np.concatenate([wq[..., nope], q_rope], -1).reshape(d, h * (dn + dr))
    joint = np.concatenate([wk[..., nope], wv], -1).reshape(d, h * (dn + dv))
    a_down, b_up = _factor(joint, layer.x, dc)
    values = {"wq_b/kernel": wq_b, "wkv_a/kernel": np.concatenate([a_down, w_kr], -1),
              "wkv_b/kernel": b_up}
    x = layer.x
    approx = (a_down @ b_up).reshape(d, h, dn + dv)
    err_k = _relative_error(x, joint.reshape(d, h, -1)[..., :dn].reshape(d, -1),
                            approx[..., :dn].reshape(d, -1))
    err_v = _relative_error(x, joint.reshape(d, h, -1)[..., dn:].reshape(d, -1),
                            approx[..., dn:].reshape(d, -1))
    err_r = _relative_error(x, k_rope.reshape(d, -1), k_hat.reshape(d, -1))
    if a.latent_norm:  # the norm's gain fitted to the latent's activations
        if x is None:
            _refuse(layer, "mha -> mla with attention.latent_norm=true fits the norm's gain "
                           "on activations, and none were measured")
        values["kv_norm/weight"] = _norm_gain(x @ a_down, x @ a_down, m.norm_eps)
    dropped = (r_src - dr) // 2
    notes = [f"layer {layer.index} mha -> mla: relative error (held-out activations) of the "
             f"non-rotary keys {err_k:.3g}, the shared rotary key {err_r:.3g}, the values "
             f"{err_v:.3g}"
             + (f"; {dropped} of {r_src // 2} rotary pairs lost their rotation (partial "
                f"RoPE: one pair in {s} kept)" if dropped else "")
             + ("; the latent norm's gain fitted" if a.latent_norm else "")]
    return Derived(values, set(), notes)


def _complex(w):
    """Real [..., 2P] with RoPE's interleaved pairs -> complex [..., P] (a pair's rotation is
    a multiplication by e^{i p theta})."""
    return w[..., 0::2] + 1j * w[..., 1::2]


def _real(z):
    return np.stack([z.real, z.imag], -1).reshape(z.shape[:-1] + (-1,))


def _shared_rotary_key(k_rope, q_rope, x):
    """One rotary key for every head (MLA's K^R) from per-head ones k_rope [d, H, r], and
    the queries q_rope [d, H, r] that keep the scores: per frequency pair, head h's key is
    taken as c_h times a shared key s (the best rank-1 fit over the heads of their
    activations, an SVD of complex [N, H]); since c_h commutes with the rotation, q_h
    absorbs conj(c_h). Exact when the heads' keys differ per pair by a rotation and a
    scale (equal keys included). Returns (w_kr [d, r], the new q_rope, the keys it
    represents [d, H, r])."""
    kc, qc = _complex(k_rope), _complex(q_rope)  # [d, H, P]
    shared, q_new, k_hat = [], [], []
    for p in range(kc.shape[-1]):
        y = kc[..., p] if x is None else x @ kc[..., p]  # [N, H]
        v = np.conj(np.linalg.svd(y, full_matrices=False)[2][0])  # top right vector [H]
        w = kc[..., p] @ v  # [d]: s = x w
        shared.append(w)
        q_new.append(qc[..., p] * v)  # conj(c_h) q_h with c_h = conj(v_h)
        k_hat.append(w[:, None] * np.conj(v)[None])
    return (_real(np.stack(shared, -1)), _real(np.stack(q_new, -1)),
            _real(np.stack(k_hat, -1)))


def mla_to_v4(layer: Layer) -> Derived:
    """MLA/DSA -> a V4-family layer (module docstring): the entry [C^KV | K^R] from W^DKV
    (with a fitted norm gain), queries with W^UK folded in, W^UV W^O as the grouped output
    (an SVD per group to o_lora_rank). The window, the per-head query norm (V4) and the sink
    change the function; compressors, indexers and sinks start fresh."""
    sa, a, m = layer.src_cfg.attention, layer.cfg.attention, layer.cfg.model
    h, dn, dr, dc, dv = sa.n_heads, sa.qk_nope_dim, sa.qk_rope_dim, sa.kv_lora_rank, \
        sa.v_head_dim
    c, ro, groups, ql = a.entry_dim, a.o_lora_rank, a.o_groups, a.q_lora_rank
    wants = {"attention.n_heads": (a.n_heads, h), "attention.entry_dim": (c, dc + dr),
             "attention.rope_dim": (a.rope_dim, dr)}
    _require(layer, "mla -> v4", "the source's latent", wants)
    src = {k: _np(v) for k, v in layer.src.items()}
    x = layer.x
    w_ukv = src["wkv_b/kernel"].reshape(dc, h, dn + dv)
    w_uk, w_uv = w_ukv[..., :dn], w_ukv[..., dn:]
    fix = np.sqrt(c / (dn + dr))  # V4 scales scores by c^-1/2, MLA by (dn + dr)^-1/2
    values, notes = {}, []

    def absorbed(wq_b):  # per-head [q_nope W^UK^T | q_pe]: [in, H * c]
        q = wq_b.reshape(wq_b.shape[0], h, dn + dr)
        q_abs = np.einsum("ihn,chn->ihc", q[..., :dn], w_uk)
        return (np.concatenate([q_abs, q[..., dn:]], -1) * fix).reshape(wq_b.shape[0], -1)

    if "wq_a/kernel" in src and src["wq_a/kernel"].shape[1] == ql:
        values["query/wq_a/kernel"] = src["wq_a/kernel"]
        values["query/q_norm/weight"] = src["q_norm/weight"]
        values["query/wq_b/kernel"] = absorbed(src["wq_b/kernel"])
    else:  # queries straight from x: factor them through a q_lora_rank latent
        if "wq_a/kernel" in src:
            full = src["wq_a/kernel"] @ absorbed(src["wq_b/kernel"])  # the source's norm aside
        else:
            full = absorbed(src["wq_b/kernel"])
        wq_a, wq_b = _factor(full, x, ql)
        values["query/wq_a/kernel"], values["query/wq_b/kernel"] = wq_a, wq_b
        values["query/q_norm/weight"] = (np.ones(ql) if x is None else
                                         _norm_gain(x @ wq_a, x @ wq_a, m.norm_eps))
        notes.append(f"queries factored to q_lora_rank {ql}: relative error "
                     f"{_relative_error(x, full, wq_a @ wq_b):.3g}")
    w_dkv = src["wkv_a/kernel"]
    values["local/wkv/kernel"] = w_dkv
    if x is not None:  # the entry's norm gain fitted to MLA's [norm(C^KV) | K^R]
        e = x @ w_dkv
        lat = e[:, :dc]
        if "kv_norm/weight" in src:
            lat = lat / np.sqrt(np.mean(lat * lat, -1, keepdims=True) + m.norm_eps)
            lat = lat * src["kv_norm/weight"]
        values["local/norm/weight"] = _norm_gain(e, np.concatenate([lat, e[:, dc:]], -1),
                                                 m.norm_eps)
    # output: head h's entry-space output [C^KV part | rotary part] -> D through W^UV W^O
    wo = src["wo/kernel"].reshape(h, dv, -1)
    per_head = np.concatenate([np.einsum("chv,hvd->hcd", w_uv, wo),
                               np.zeros((h, dr, wo.shape[-1]))], 1)  # [H, c, D]
    grouped = per_head.reshape(groups, (h // groups) * c, -1)
    factors = [_factor(mat, None, ro) for mat in grouped]  # per group [H/g * c, ro] [ro, D]
    errs = [_relative_error(None, mat, a_g @ b_g) for mat, (a_g, b_g) in zip(grouped, factors)]
    values["core/out/wo_a"] = np.stack([a_g for a_g, _ in factors])
    values["core/out/wo_b/kernel"] = np.concatenate([b_g for _, b_g in factors])
    changes = ["the window" if a.window else None,
               "the per-head query norm" if a.query_norm else None, "the sink"]
    notes.append(f"output W^UV W^O to o_lora_rank {ro} per group: relative error "
                 f"{max(errs):.3g}; changed by {', '.join(c for c in changes if c)}")
    fresh = {p for p in layer.new if p not in values}
    notes = [f"layer {layer.index} mla -> v4: " + "; ".join(notes)]
    return Derived(values, fresh, notes)


def _virtual_mla(layer: Layer) -> Layer:
    """The MLA an MHA layer passes through on its way to V4: its latent is V4's entry."""
    a = layer.cfg.attention
    sa = layer.src_cfg.attention
    virtual = dataclasses.replace(
        layer.cfg, attention=dataclasses.replace(
            a, qk_rope_dim=a.rope_dim, qk_nope_dim=sa.head_dim - a.rope_dim,
            kv_lora_rank=a.entry_dim - a.rope_dim, v_head_dim=sa.head_dim, q_lora_rank=0,
            latent_norm=False, rope_theta=sa.rope_theta, rope_scaling=sa.rope_scaling))
    return dataclasses.replace(layer, cfg=virtual)


def mha_to_v4(layer: Layer) -> Derived:
    first = _virtual_mla(layer)
    mla = mha_to_mla(first)
    src = {**{k: v for k, v in layer.src.items() if k == "wo/kernel"}, **mla.values}
    second = mla_to_v4(dataclasses.replace(layer, src=src, src_cfg=first.cfg))
    return Derived(second.values, second.fresh, mla.notes + second.notes)


def add_fresh(layer: Layer) -> Derived:
    """Same parameters, plus fresh ones (MLA -> DSA: the indexer)."""
    return Derived({}, {p for p in layer.new if p not in layer.src}, [])


def mha_to_dsa(layer: Layer) -> Derived:
    """MHA -> MLA, and the indexer fresh (MHA's wk is no indexer key)."""
    mla = mha_to_mla(layer)
    kept = set(mla.values) | {"wo/kernel"}
    return Derived(mla.values, {p for p in layer.new if p not in kept}, mla.notes)


# (source family, new family) -> rule; a layer of the same family copies by path and shape.
RULES: dict[tuple[Family, Family], Callable[[Layer], Derived]] = {
    (Family.MHA, Family.MLA): mha_to_mla,
    (Family.MHA, Family.DSA): mha_to_dsa,
    (Family.MLA, Family.DSA): add_fresh,
    (Family.MHA, Family.V4): mha_to_v4,
    (Family.MLA, Family.V4): mla_to_v4,
    (Family.DSA, Family.V4): mla_to_v4,
}
NEEDS_ACTIVATIONS = {Family.MHA, Family.MLA, Family.DSA}  # sources a rule calibrates on


# ------------------------------------------------------------------------------- driver
def load_source(run_dir, step: int | None = None):
    """(source model, its config, the step loaded)."""
    return checkpoint.load_params(run_dir, step=step)


def attention_inputs(model, tokens) -> list[np.ndarray]:
    """Each layer's attention input (the normed residual) [B*T, D] for `tokens`, running the
    stack layer by layer (the model's config unrolled, so each layer is one Block)."""
    cfg = model.cfg
    unrolled = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                  scan_layers=False))
    params = nnx.to_pure_dict(nnx.state(model))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: type(model)(unrolled,
                                                                    rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, with_layers(unrolled, params, per_layer(cfg, params)))
    from dsattn.attention.context import StackContext

    def inputs(flat_model, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                     tokens.shape)
        x, ctx, out = flat_model.embedding(tokens), StackContext(), []
        for i, block in enumerate(flat_model.blocks):
            if i == cfg.attention.ced_split and i:
                ctx = StackContext(encoder_out=x)
            out.append(block.attn_norm(x).reshape(-1, x.shape[-1]))
            x, _, ctx = block(x, positions, None, ctx)
        return out

    return [_np(x) for x in _jitted(inputs, nnx.merge(graphdef, state))(jnp.asarray(tokens))]


def _jitted(fn, model):
    """fn(model, *args) as one compiled program of args (run eagerly, a model's forward
    compiles every operation on its own)."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda st, *a: fn(nnx.merge(graphdef, st), *a))
    return lambda *args: step(state, *args)


def mean_kl(source, target, batches) -> float:
    """KL(source || target) in nats per token, the mean over `batches`' inputs."""
    def kl(pair, tokens):
        lp, lq = (jax.nn.log_softmax(m(tokens).astype(jnp.float32), -1) for m in pair)
        return jnp.sum(jnp.exp(lp) * (lp - lq), -1)

    both = _jitted(kl, nnx.List([source, target]))
    per_token = [np.asarray(both(jnp.asarray(b["inputs"]))) for b in batches]
    return float(np.mean(np.concatenate([k.ravel() for k in per_token])))


def convert(cfg: Config, fresh: dict, source, step: int | None = None, *,
            calibration=None, held_out=(), graphdef=None) -> Conversion:
    """The parameters of `cfg`'s model started from the run directory `source` (at `step`,
    default its latest): `fresh` are the new model's initial parameters (a pure dict), which
    supply whatever starts fresh. `calibration`: token ids [B, T] whose activations the rules
    fit on; `held_out`: batches on which the KL to the source is measured (with `graphdef`,
    the new model's). Raises ConfigError for a parameter no rule covers."""
    src_model, src_cfg, step = load_source(source, step)
    src_params = nnx.to_pure_dict(nnx.state(src_model))
    src_specs, specs = plan.resolve(src_cfg), plan.resolve(cfg)
    if len(src_specs) != len(specs):
        raise ConfigError(f"--init-from {source}: it has {len(src_specs)} layers, this "
                          f"config {len(specs)}; layer i starts from the source's layer i")
    src_layers, new_layers = per_layer(src_cfg, src_params), per_layer(cfg, fresh)
    needs_x = any(s.kind.family != t.kind.family and s.kind.family in NEEDS_ACTIVATIONS
                  for s, t in zip(src_specs, specs))
    xs = (attention_inputs(src_model, calibration) if needs_x and calibration is not None
          else [None] * len(specs))
    rows, notes, names, out_layers = [], [], [], []
    for i, (s_spec, spec, s_layer, layer) in enumerate(zip(src_specs, specs, src_layers,
                                                           new_layers)):
        sf, tf = s_spec.kind.family, spec.kind.family
        names.append(s_spec.kind.name if s_spec.kind == spec.kind
                     else f"{s_spec.kind.name} -> {spec.kind.name}")
        s_flat, t_flat = flat(s_layer), flat(layer)
        s_attn = {k[5:]: v for k, v in s_flat.items() if k.startswith("attn/")}
        t_attn = {k[5:]: v for k, v in t_flat.items() if k.startswith("attn/")}
        if sf == tf:
            derived = Derived({}, {p for p in t_attn if p not in s_attn}, [])
        elif (sf, tf) in RULES:
            derived = RULES[sf, tf](Layer(s_attn, t_attn, src_cfg, cfg, xs[i], i))
            notes += derived.notes
        else:
            raise ConfigError(
                f"--init-from {source}: layer {i}: no conversion rule from {sf.value} to "
                f"{tf.value} layers; rules: "
                + ", ".join(f"{a.value} -> {b.value}" for a, b in RULES))
        rule = "" if sf == tf else f"{sf.value} -> {tf.value}"
        out = {}
        for path, init in t_flat.items():
            inner = path[5:] if path.startswith("attn/") else None
            if inner is not None and inner in derived.values:
                out[path] = _cast(derived.values[inner], init, f"layer {i} {path}")
                rows.append(Row(f"layer {i}", path, How.DERIVED, rule))
            elif inner is not None and inner in derived.fresh:
                out[path] = init
                rows.append(Row(f"layer {i}", path, How.NEW))
            else:
                out[path] = _copied(s_flat, path, init, f"--init-from {source}: layer {i}")
                rows.append(Row(f"layer {i}", path, How.COPIED))
        out_layers.append(nested(out, layer))
    params = with_layers(cfg, fresh, out_layers)
    for name, key in (("embedding", "embedding"), ("final norm", "norm")):
        got = flat(params[key])
        src = flat(src_params[key])
        params[key] = nested({p: _copied(src, p, v, f"--init-from {source}: {name}")
                              for p, v in got.items()}, params[key])
        copied = [Row(name, p, How.COPIED) for p in got]
        rows = copied + rows if key == "embedding" else rows + copied
    conv = Conversion(params, rows, notes, str(source), step, names)
    if held_out and graphdef is not None:
        target = nnx.merge(graphdef, nnx.State(params))
        conv.kl = mean_kl(src_model, target, held_out)
    return conv


def _cast(value, like, what: str):
    if tuple(np.shape(value)) != tuple(like.shape):
        raise ConfigError(f"--init-from: {what}: the rule made {np.shape(value)}, the model "
                          f"has {tuple(like.shape)}")
    return jnp.asarray(value, like.dtype)


def _copied(src: dict, path: str, like, where: str):
    """The source's value at `path`, which must have `like`'s shape."""
    if path not in src:
        raise ConfigError(f"{where}: {path}: the source has no such parameter, and no "
                          f"conversion rule makes it")
    if tuple(src[path].shape) != tuple(like.shape):
        raise ConfigError(f"{where}: {path}: shape {tuple(like.shape)} here, "
                          f"{tuple(src[path].shape)} in the source, and no conversion rule "
                          f"covers it")
    return jnp.asarray(src[path], like.dtype)
