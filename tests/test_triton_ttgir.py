"""The TTGIR warpgroup split (backends/triton/compiler.py): the text rewrite, when it applies, and
the real decode kernel compiled with it for sm_90 on CPU (no GPU needed).

The split is what halves the 64-row decode tile's score MMAs on Hopper; its numerics are checked
on the GPU by the conformance suite (``test_triton_64_row_tiles_bf16``).
"""

from __future__ import annotations

import pytest

from jax_mla.backends.triton.compiler import split_broadcast_wgmma
from jax_mla.backends.triton.plan import kernel_config

from conftest import has_triton_cuda_backend, run_compiler_script

HEADER = """\
#mma = #ttg.nvidia_mma<{{versionMajor = 3, versionMinor = 0, warpsPerCTA = [{w}, 1], \
instrShape = [16, {n}, 16]}}>
#mma1 = #ttg.nvidia_mma<{{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], \
instrShape = [16, 256, 16]}}>
module {{
  %s = ttng.warp_group_dot %a, %b, %c : !ttg.memdesc<{rows}x512xbf16> * \
!ttg.memdesc<512x{cols}xbf16> -> tensor<{rows}x{cols}xf32, #mma>
  %m = tt.reduce %s : tensor<{rows}x{cols}xf32, #mma> -> \
tensor<{rows}xf32, #ttg.slice<{{dim = 1, parent = #mma}}>>
  %k = tt.make_range : tensor<1x{cols}xi32, #mma>
  %x = ttg.convert_layout %y : tensor<{rows}x1xf32, #mma> -> tensor<{rows}x1xf32, #mma1>
  %o = ttng.warp_group_dot %p, %v, %acc : tensor<{rows}x{cols}xbf16> * !ttg.memdesc<> -> \
tensor<{rows}x512xf32, #mma1>
}}
"""


def _mma_line(text: str, alias: str = "#mma") -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(alias + " ="))


@pytest.mark.parametrize("cols, n, want_n", [(64, 32, 32), (32, 32, 16), (128, 64, 64),
                                             (48, 16, 8)])
def test_broadcast_layout_is_split_by_columns(cols, n, want_n):
    text = HEADER.format(w=8, n=n, rows=64, cols=cols)
    new, count = split_broadcast_wgmma(text)
    assert count == 1
    assert _mma_line(new) == (
        "#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], "
        f"instrShape = [16, {want_n}, 16]}}>")
    assert _mma_line(new, "#mma1") == _mma_line(text, "#mma1")  # the P @ V layout is untouched
    # Only the definition changed; every use refers to the alias.
    assert [a for a in new.splitlines()[1:]] == [a for a in text.splitlines()[1:]]
    again, count2 = split_broadcast_wgmma(new)
    assert count2 == 0 and again == new


@pytest.mark.parametrize("w, rows, extra", [
    (4, 64, ""),       # one warpgroup: nothing is broadcast
    (8, 128, ""),      # two warpgroups over 128 rows: no broadcast either
    (8, 64, "%q = ttg.convert_layout %z : tensor<64x512xbf16, #blk> -> tensor<64x512xbf16, "
            "#ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>>\n"),  # register operand
])
def test_other_layouts_are_left_alone(w, rows, extra):
    text = HEADER.format(w=w, n=32, rows=rows, cols=64) + extra
    new, count = split_broadcast_wgmma(text)
    assert count == 0 and new == text


def test_columns_too_narrow_to_split_are_left_alone():
    text = HEADER.format(w=8, n=8, rows=64, cols=8)
    assert split_broadcast_wgmma(text) == (text, 0)


def test_split_is_chosen_for_cuda_64_row_tiles_only(monkeypatch):
    monkeypatch.delenv("JAX_MLA_TRITON_WG_SPLIT", raising=False)
    # The Triton kernel's tiles (the Gluon kernel, sm90, serves 64-row tiles where it can).
    assert kernel_config(128, 1, 64, "cuda", sm90=False).wg_split  # 64 heads a block, 8 warps
    assert kernel_config(16, 4, 1, "cuda", sm90=False).wg_split  # verify: 4 tokens x 16 heads
    assert not kernel_config(16, 1, 64, "cuda").wg_split  # 16 rows: mma.sync, 4 warps
    assert not kernel_config(128, 1, 64, "rocm").wg_split  # no wgmma on AMD
    assert not kernel_config(128, 1, 64, "cpu").wg_split
    monkeypatch.setenv("JAX_MLA_TRITON_WG_SPLIT", "0")
    assert not kernel_config(128, 1, 64, "cuda", sm90=False).wg_split


SCRIPT = r"""
import json
from jax_mla.backends.triton.aot import compile_report
from jax_mla.backends.triton.launch import ptxas_spills
out = {}
for name, h, q, page, split in [("h128_base", 128, 1, 64, False), ("h128_split", 128, 1, 64, True),
                                ("q4_page1_split", 16, 4, 1, True)]:
    r = compile_report(h, q, page, wg_split=split)
    out[name] = dict(shared=r["shared"], rewrites=r["rewrites"], wgmma=r["wgmma"],
                     spills=ptxas_spills(r["ptx"]), block_m=r["config"].block_m,
                     warps=r["config"].num_warps)
print(json.dumps(out))
"""


@pytest.mark.skipif(not has_triton_cuda_backend(), reason="triton without its NVIDIA backend")
def test_decode_kernel_compiles_split_for_sm90():
    """The real kernel: the rewrite applies once, halves the score MMAs, and still fits."""
    r = run_compiler_script(SCRIPT, timeout=600)
    base, split = r["h128_base"], r["h128_split"]
    assert base["block_m"] == 64 and base["warps"] == 8
    assert base["rewrites"] == 0 and split["rewrites"] == 1 and r["q4_page1_split"]["rewrites"] == 1
    # Q @ K^T: 576 / 16 = 36 k-steps of n32 per 32 score columns, in the unmasked and the masked
    # loop. Unsplit, each warpgroup runs both column halves (144); split, one each (72).
    assert base["wgmma"]["m64n32k16"] == 2 * split["wgmma"]["m64n32k16"] == 144
    assert base["wgmma"]["m64n256k16"] == split["wgmma"]["m64n256k16"]  # P @ V unchanged
    assert r["q4_page1_split"]["wgmma"] == split["wgmma"]
    for name in ("h128_split", "q4_page1_split"):
        assert r[name]["shared"] <= 227 * 1024, r[name]
    # Half the score registers: never more spills than the unsplit tile (triton 3.6, the GPU's:
    # 48 -> 0 bytes; triton 3.9: 588 -> 344).
    if base["spills"] is not None:
        assert split["spills"] <= base["spills"], r


def test_32_row_blocks_are_one_padded_wgmma_tile_on_cuda(monkeypatch):
    monkeypatch.delenv("JAX_MLA_TRITON_WG_SPLIT", raising=False)
    one = kernel_config(16, 2, 64, "cuda", sm90=False)  # Q=2 x 16 heads: 32 rows in 64
    assert (one.block_m, one.num_head_blocks, one.heads_per_block) == (64, 1, 16)
    assert one.wg_split and one.num_warps == 8
    monkeypatch.setenv("JAX_MLA_TRITON_MAX_ROWS", "16")  # the former default, for A/B runs
    two = kernel_config(16, 2, 64, "cuda", sm90=False)
    assert (two.block_m, two.num_head_blocks, two.wg_split) == (16, 2, False)


@pytest.mark.parametrize("cc, want", [("9.0", True), ("8.0", False), ("10.0", False)])
def test_only_hopper_gets_the_wgmma_defaults(monkeypatch, cc, want):
    import types

    import jax

    from jax_mla.problem import detect_target

    monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(compute_capability=cc)])
    assert detect_target.__wrapped__("cuda").hopper is want
    assert detect_target.__wrapped__("rocm").hopper is False


def test_loop_spills_counts_spills_inside_innermost_loops_only():
    """``compiler.loop_spills_of_sass``: a spill in the innermost loop counts, one in the outer
    loop or before any loop does not, and a barrier's spin loop (a few instructions) is no
    loop."""
    from jax_mla.backends.triton.compiler import loop_spills_of_sass

    def ins(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;   /* 0x0 */"

    body = [ins(0x00, "STL [R1], R0")]  # prologue
    body += [ins(0x10 * i, "IADD3 R2, R2, 0x1, RZ") for i in range(1, 4)]
    body += [ins(0x40, "LDL R3, [R1]")]  # outer loop body
    body += [ins(0x10 * i, "FFMA R4, R4, R4, R4") for i in range(5, 20)]
    body += [ins(0x140, "STL [R1+0x4], R4")]  # inner loop body
    body += [ins(0x10 * i, "FFMA R4, R4, R4, R4") for i in range(21, 40)]
    body += [ins(0x280, "@P0 BRA 0x50")]  # inner loop: 0x50 .. 0x280
    body += [ins(0x290, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R5], R6")]
    body += [ins(0x2a0, "LDL R7, [R1+0x8]"), ins(0x2b0, "@!P1 BRA 0x290")]  # a spin loop
    body += [ins(0x2c0, "@P2 BRA 0x10")]  # outer loop: 0x10 .. 0x2c0
    assert loop_spills_of_sass("\n".join(body)) == 1
    # Out-of-line code after the last EXIT: a barrier's retry loop that branches back into the
    # body is no loop around it (read as one, the spin loop's LDL would count).
    body += [ins(0x2d0, "EXIT"), ins(0x2e0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R5], R6"),
             ins(0x2f0, "@!P0 BRA 0x2e0"), ins(0x300, "BRA 0x60")]
    assert loop_spills_of_sass("\n".join(body)) == 1
    body[-1] = ins(0x300, "@P3 BRA 0x60")  # the same branch in the body (no EXIT before it)
    assert loop_spills_of_sass("\n".join(body[:-4] + [body[-1], ins(0x310, "EXIT")])) == 2
