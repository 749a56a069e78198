"""Minimal 2-layer transformer (pure JAX/optax) on the mqar branch's format=mqar task."""
import sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import jax, jax.numpy as jnp, numpy as np, optax
from dsattn import datasource, recall
src = sys.argv[1]
pos_kind = sys.argv[2] if len(sys.argv) > 2 else "learned"
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
spec = datasource.parse(src).recall
train, val, wtr, wva, desc = recall.mqar_streams(spec, 0.05)
B, T, D, H, L = 64, spec.block, 64, 4, 2
hd = D // H
def batch(rng, toks, w):
    n = len(toks) // spec.block
    s = rng.integers(0, n - 1, B) * spec.block
    idx = s[:, None] + np.arange(T + 1)
    return toks[idx[:, :-1]], toks[idx[:, 1:]], w[idx[:, 1:]]
k = jax.random.split(jax.random.PRNGKey(0), 20)
init = lambda key, shape, s=0.02: jax.random.normal(key, shape) * s
P = {"emb": init(k[0], (256, D)), "pos": init(k[1], (T, D)),
     "layers": [{"qkv": init(k[2+i], (D, 3 * D)), "o": init(k[5+i], (D, D)),
                 "w1": init(k[8+i], (D, 4*D)), "w2": init(k[11+i], (4*D, D))} for i in range(L)],
     "out": init(k[15], (D, 256))}
def rope(x):
    t = jnp.arange(x.shape[1])[:, None]; f = 10000 ** (-jnp.arange(0, hd, 2) / hd)
    a = t * f; c, s = jnp.cos(a)[None, :, None], jnp.sin(a)[None, :, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(x.shape)
def norm(x): return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
def fwd(P, x):
    h = P["emb"][x] + (P["pos"][None] if pos_kind == "learned" else 0)
    mask = jnp.tril(jnp.ones((T, T), bool))
    for l in P["layers"]:
        q, kk, v = jnp.split(norm(h) @ l["qkv"], 3, -1)
        q, kk, v = (a.reshape(B, T, H, hd) for a in (q, kk, v))
        if pos_kind == "rope": q, kk = rope(q), rope(kk)
        s = jnp.einsum("bthd,bshd->bhts", q, kk) / hd ** 0.5
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), -1)
        h = h + jnp.einsum("bhts,bshd->bthd", p, v).reshape(B, T, D) @ l["o"]
        h = h + jax.nn.gelu(norm(h) @ l["w1"]) @ l["w2"]
    return norm(h) @ P["out"]
def loss(P, x, y, w):
    lp = jax.nn.log_softmax(fwd(P, x))
    nll = -jnp.take_along_axis(lp, y[..., None], -1)[..., 0]
    return (nll * w).sum() / w.sum()
def acc(P, x, y, w):
    return ((jnp.argmax(fwd(P, x), -1) == y) * w).sum() / w.sum()
lr = float(sys.argv[4]) if len(sys.argv) > 4 else 1e-3
opt = optax.adamw(optax.warmup_cosine_decay_schedule(0, lr, 100, steps), weight_decay=0.1)
st = opt.init(P)
@jax.jit
def step(P, st, x, y, w):
    l, g = jax.value_and_grad(loss)(P, x, y, w)
    u, st = opt.update(g, st, P)
    return optax.apply_updates(P, u), st, l
rng = np.random.default_rng(0); vr = np.random.default_rng(1)
t0 = time.time()
for i in range(1, steps + 1):
    P, st, l = step(P, st, *batch(rng, train, wtr))
    if i % 250 == 0:
        a = np.mean([float(jax.jit(acc)(P, *batch(vr, val, wva))) for _ in range(4)])
        print(f"{pos_kind} step {i} loss {float(l):.3f} acc {a:.3f} {time.time()-t0:.0f}s", flush=True)
