"""Minimal transformer (pure JAX/optax) on format=mqar; knobs for the plateau hypotheses."""
import argparse, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import jax, jax.numpy as jnp, numpy as np, optax
from dsattn import datasource, recall

ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("--pos", default="rope")  # rope | learned | none
ap.add_argument("--heads", type=int, default=4)
ap.add_argument("--D", type=int, default=64)
ap.add_argument("--L", type=int, default=2)
ap.add_argument("--B", type=int, default=64)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--sched", default="cos")  # cos | const
ap.add_argument("--warmup", type=int, default=100)
ap.add_argument("--wd", type=float, default=0.1)
ap.add_argument("--b2", type=float, default=0.999)
ap.add_argument("--steps", type=int, default=2000)
ap.add_argument("--every", type=int, default=250)
ap.add_argument("--tmax", type=float, default=400)
ap.add_argument("--window", type=int, default=0)  # >0: sliding window (every layer)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--ffn", type=int, default=1)
ap.add_argument("--shift", type=int, default=0)  # diagnostic: add emb2(x[t-1]) (a built-in previous-token path)
a = ap.parse_args()
print(" ".join(sys.argv[1:]), flush=True)
spec = datasource.parse(a.src).recall
train, val, wtr, wva, desc = recall.mqar_streams(spec, 0.05)
print(desc, flush=True)
B, T, D, H, L = a.B, spec.block, a.D, a.heads, a.L
hd = D // H


def batch(rng, toks, w, B=B):
    n = len(toks) // spec.block
    s = rng.integers(0, n - 1, B) * spec.block
    idx = s[:, None] + np.arange(T + 1)
    return toks[idx[:, :-1]], toks[idx[:, 1:]], w[idx[:, 1:]]


k = jax.random.split(jax.random.PRNGKey(a.seed), 20)
init = lambda key, shape, s=0.02: jax.random.normal(key, shape) * s
P = {"emb": init(k[0], (256, D)), "pos": init(k[1], (T, D)),
     "layers": [{"qkv": init(k[2 + i], (D, 3 * D)), "o": init(k[5 + i], (D, D)),
                 "w1": init(k[8 + i], (D, 4 * D)), "w2": init(k[11 + i], (4 * D, D))} for i in range(L)],
     "out": init(k[15], (D, 256)), "emb2": init(k[16], (256, D))}


def rope(x):
    t = jnp.arange(x.shape[1])[:, None]; f = 10000 ** (-jnp.arange(0, hd, 2) / hd)
    ang = t * f; c, s = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(x.shape)


def norm(x): return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def fwd(P, x):
    b, t = x.shape
    h = P["emb"][x] + (P["pos"][None, :t] if a.pos == "learned" else 0)
    if a.shift:
        h = h + jnp.pad(P["emb2"][x], ((0, 0), (1, 0), (0, 0)))[:, :t]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    mask = j <= i
    if a.window:
        mask &= j > i - a.window
    for l in P["layers"]:
        q, kk, v = jnp.split(norm(h) @ l["qkv"], 3, -1)
        q, kk, v = (z.reshape(b, t, H, hd) for z in (q, kk, v))
        if a.pos == "rope": q, kk = rope(q), rope(kk)
        s = jnp.einsum("bthd,bshd->bhts", q, kk) / hd ** 0.5
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), -1)
        h = h + jnp.einsum("bhts,bshd->bthd", p, v).reshape(b, t, D) @ l["o"]
        if a.ffn:
            h = h + jax.nn.gelu(norm(h) @ l["w1"]) @ l["w2"]
    return norm(h) @ P["out"]


def loss(P, x, y, w):
    lp = jax.nn.log_softmax(fwd(P, x))
    nll = -jnp.take_along_axis(lp, y[..., None], -1)[..., 0]
    return (nll * w).sum() / w.sum()


pred = jax.jit(lambda P, x: jnp.argmax(fwd(P, x), -1))
sched = (optax.warmup_cosine_decay_schedule(0, a.lr, a.warmup, a.steps) if a.sched == "cos"
         else optax.join_schedules([optax.linear_schedule(0, a.lr, a.warmup), optax.constant_schedule(a.lr)], [a.warmup]))
opt = optax.adamw(sched, b2=a.b2, weight_decay=a.wd)
st = opt.init(P)


@jax.jit
def step(P, st, x, y, w):
    l, g = jax.value_and_grad(loss)(P, x, y, w)
    u, st = opt.update(g, st, P)
    return optax.apply_updates(P, u), st, l


# probes: the same rows recall_curve uses (query ends a row of T tokens)
dists = [d for d in (2, 4, 8, 16, 24, 30, 48, 62, 96, 126) if d <= T - 2]
pr = recall.probes(dists, 64, T, spec, background=val, seed=0)
vr = np.random.default_rng(1)
vb = [batch(vr, val, wva) for _ in range(4)]
rng = np.random.default_rng(a.seed)
t0 = time.time()
for i in range(1, a.steps + 1):
    P, st, l = step(P, st, *batch(rng, train, wtr))
    if i % a.every == 0 or time.time() - t0 > a.tmax:
        tt = time.time() - t0
        va = np.mean([float(((np.asarray(pred(P, x)) == y) * (w > 0) * (y >= 128)).sum() / ((w > 0) * (y >= 128)).sum()) for x, y, w in vb])
        pp = np.zeros_like(pr.tokens); pp[:, 1:] = np.asarray(pred(P, pr.tokens))[:, :-1]
        sc = recall.score(pp, pr)
        print(f"step {i:5d} {tt:5.0f}s ce {float(l):.3f} val {va:.3f} probes "
              + " ".join(f"{d}:{v:.2f}" for d, v in sc.items()), flush=True)
        if tt > a.tmax:
            break
