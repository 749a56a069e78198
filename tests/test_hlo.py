"""dsattn.bench.hlo: the kernels one run of a compiled program launches, read off its HLO
text, against counts worked out by hand."""

import jax
import jax.numpy as jnp
import pytest

from dsattn.bench import hlo

# An entry that runs a fusion, a Triton kernel (named in its MLIR backend config) and a loop of
# 12 trips holding a fusion, a Mosaic kernel (named by its instruction), an all-reduce, a
# compare and a conditional whose larger branch (true) holds two fusions; the loop's
# condition holds one more compare.
TEXT = """HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_computation (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %sine = f32[4]{0} sine(%param_0)
}

%small (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_computation
}

%large (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %a = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_computation
  ROOT %b = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4]{0} get-tuple-element(%t), index=1
  %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %indexer_score.4 = f32[4]{0} custom-call(%y), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"TUzvUgFN"}}
  %r = f32[4]{0} all-reduce(%indexer_score.4), replica_groups={}, to_apply=%fused_computation
  %p = pred[] compare(%i, %i), direction=EQ
  %c = f32[4]{0} conditional(%p, %r, %r), true_computation=%large, false_computation=%small
  ROOT %o = (s32[], f32[4]{0}) tuple(%i, %c)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main.9 (x: f32[4], /*index=1*/y: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  %g = f32[4]{0} custom-call(%f), custom_call_target="__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 1 : i32, name = "decode_attention", num_stages = 2 : i32}
  %zero = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%zero, %g)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_counts_every_kernel_of_one_run_by_hand():
    got = hlo.launches(TEXT)
    # entry: fusion + Triton kernel; each of 12 trips: fusion, Mosaic kernel, all-reduce,
    # the larger branch's two fusions, and the condition's compare
    assert got.by_kind == {"fusion": 1 + 12 * 3, "custom-call decode_attention": 1,
                           "custom-call indexer_score": 12, "collective all-reduce": 12,
                           "compare": 24}
    assert got.total == 2 + 12 * 7
    assert got.loops == [("w", 12, 7)]
    assert "fusion" in got.kinds and "custom-call indexer_score" in got.kinds
    assert got.fusions == {"f": 1, "y": 12, "a": 12, "b": 12}  # by instruction name
    assert got.per(4) == pytest.approx(got.total / 4)


def test_a_compiled_loop_counts_its_trips():
    """A loop of 7 trips compiled here: its body's kernels count seven times."""
    def f(x):
        return jax.lax.fori_loop(0, 7, lambda i, x: jnp.sin(x) @ x, x)

    text = jax.jit(f).lower(jnp.ones((8, 8))).compile().as_text()
    got = hlo.launches(text)
    ((_, trips, per_trip),) = got.loops
    assert trips == 7 and per_trip >= 2  # the sine and the matmul, at least
    assert got.total >= 7 * per_trip


def test_text_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY"):
        hlo.launches("HloModule empty\n")
