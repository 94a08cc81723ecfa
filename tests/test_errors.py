"""Bad input raises early, naming the argument and the rule."""

import jax
import jax.numpy as jnp
import pytest

import jax_mla


@pytest.fixture
def ok():
    md = jax_mla.build_decode_metadata(jnp.zeros((2, 2), jnp.int32), jnp.array([3, 4]),
                                       page_size=4, qlen=2)
    return jnp.ones((4, 8, 576), jnp.bfloat16), jnp.ones((4, 4, 576), jnp.bfloat16), md


def call(q, cache, md, **kw):
    kw.setdefault("scale", 0.1)
    return jax_mla.mla_attention(q, cache, md, **kw)


def test_rank_width_rows_and_page_size(ok):
    q, cache, md = ok
    with pytest.raises(ValueError, match=r"q must be \[T, H, D\]"):
        call(q[0], cache, md)
    with pytest.raises(ValueError, match="must equal the kv_cache width"):
        call(q[..., :570], cache, md, kv_lora_rank=512)
    with pytest.raises(ValueError, match="T must equal B \\* Q"):
        call(q[:3], cache, md)
    with pytest.raises(ValueError, match="does not match metadata.page_size"):
        call(q, jnp.ones((8, 2, 576), jnp.bfloat16), md)
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_pages, page_size, D\]"):
        call(q, cache[0], md)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        call(q[..., :96], cache[..., :96], md)
    with pytest.raises(ValueError, match="kv_lora_rank=600"):
        call(q, cache, md, kv_lora_rank=600)
    with pytest.raises(TypeError, match="metadata must be a jax_mla.DecodeMetadata"):
        call(q, cache, {"seq_lens": 1})


def test_dtypes(ok):
    q, cache, md = ok
    with pytest.raises(TypeError, match="q dtype int32"):
        call(q.astype(jnp.int32), cache, md)
    with pytest.raises(TypeError, match="kv_cache dtype int8"):
        call(q, cache.astype(jnp.int8), md)
    with pytest.raises(ValueError, match="pass q_scale"):
        call(q.astype(jnp.float8_e4m3fn), cache, md)
    with pytest.raises(TypeError, match="dtypes differ"):
        call((q[..., :512], q[..., 512:].astype(jnp.float32)), cache, md)


@pytest.mark.parametrize("feature,value", [("alibi_slopes", jnp.ones(8)), ("sliding_window", 128),
                                           ("logits_soft_cap", 30.0)])
def test_unsupported_features(ok, feature, value):
    q, cache, md = ok
    with pytest.raises(NotImplementedError, match=feature):
        call(q, cache, md, **{feature: value})


def test_backend_selection(ok):
    q, cache, md = ok
    with pytest.raises(ValueError, match="backend='cuda-magic' is not one of"):
        call(q, cache, md, backend="cuda-magic")
    bad = jnp.ones((4, 130, 576), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"num_heads \(q.shape\[1\]\)=130 cannot be served"):
        call(bad, cache, md, backend="aiter")
    # Valid heads but no AITER on this host: a clear error, never a silent fallback.
    with pytest.raises((RuntimeError, ValueError), match="aiter"):
        call(q, cache, md, backend="aiter")
    # The XLA reference has no head rule: 130 heads work there.
    assert call(bad, cache, md, backend="xla").shape == (4, 130, 512)


def test_a_call_that_does_not_match_the_plan_names_both():
    """A planned metadata is only read: a different problem is an error, never a silent re-plan."""
    table, lens = jnp.zeros((2, 2), jnp.int32), jnp.array([3, 4])
    q, cache = jnp.ones((4, 8, 576), jnp.bfloat16), jnp.ones((4, 4, 576), jnp.bfloat16)
    md = jax_mla.build_decode_metadata(table, lens, page_size=4, qlen=2, q=q, kv_cache=cache,
                                       backend="xla")
    assert md.plan.backend == "xla" and md.plan.problem.num_heads == 8
    assert call(q, cache, md).shape == (4, 8, 512)
    with pytest.raises(ValueError, match="num_heads: planned 8, call 16"):
        call(jnp.ones((4, 16, 576), jnp.bfloat16), cache, md)
    with pytest.raises(ValueError, match="kv_dtype: planned bfloat16, call float8_e4m3fn"):
        call(q, cache.astype(jnp.float8_e4m3fn), md, kv_scale=1.0)
    with pytest.raises(ValueError, match="q_dtype: planned bfloat16, call float32"):
        call(q.astype(jnp.float32), cache, md)
    with pytest.raises(ValueError, match="planned for backend='xla'.*backend='triton'"):
        call(q, cache, md, backend="triton")


def test_planning_reads_the_problem_from_example_arrays_or_arguments():
    table, lens = jnp.zeros((2, 2), jnp.int32), jnp.array([3, 4])
    q = jax.ShapeDtypeStruct((2, 16, 576), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 4, 576), jnp.float8_e4m3fn)
    by_example = jax_mla.build_decode_metadata(table, lens, q=q, kv_cache=kv, backend="xla")
    by_args = jax_mla.build_decode_metadata(table, lens, page_size=4, num_heads=16,
                                            kv_dtype=jnp.float8_e4m3fn, backend="xla")
    assert by_example.plan == by_args.plan  # static and hashable: part of the jit cache key
    assert hash(by_example.plan) == hash(by_args.plan)
    assert jax_mla.build_decode_metadata(table, lens, page_size=4).plan is None
    with pytest.raises(ValueError, match="page_size is required"):
        jax_mla.build_decode_metadata(table, lens, num_heads=16)
