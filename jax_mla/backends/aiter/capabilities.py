"""What AITER can run on each AMD architecture, and vLLM's routing predicates, as pure functions.

Everything here is data or a pure function of explicit arguments (arch, build, dtypes, head and
query counts, the small-head mode): nothing probes a GPU or imports ``aiter``. The routing is
decided once, when the decode metadata is built (:func:`decide_route`), carried in it, and only
read by the attention call.

The rules are docs/design.md §7.5-§7.8: read from AITER's ``hsa/<arch>/mla/mla_asm.csv``,
``asm_mla.cu``, ``aiter/mla.py`` and ``csrc/kernels/mla/metadata/v1_2_device.cuh`` at
ROCm/aiter e4048607 (:data:`AITER_COMMIT`), with vLLM's ROCm AITER MLA backend as the
tie-breaker.

Which asm decode kernels exist is an :class:`AsmKernelSet`: the one derived from the installed
AITER's ``mla_asm.csv`` (``native.installed_kernel_set``, filled in by ``plan.make_plan``), or,
where no installation is found, the static tables :data:`ASM_KERNELS` (the pinned commit's
tables, checked equal to the ones derived from its csv). :func:`asm_kernel_available` returns
``None`` ("unknown") for a row whose LSE support is ``None``; callers only refuse a definite
``False``.

Dtype names used throughout: ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8"`` (either fp8 e4m3
flavour: AITER's C++ only distinguishes "is fp8"; the arch picks fnuz or fn, :func:`fp8_dtype`).
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import jax.numpy as jnp

from jax_mla import env
from jax_mla import heads as _heads

# The ROCm/aiter commit the tables, rules and kernel-argument block were read from.
AITER_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"

ARCHES = ("gfx942", "gfx950")
SMALL_HEAD_MODES = ("auto", "gluon", "asm")
MIN_HEADS = _heads.MIN_HEADS  # 16: AITER's asm decode head group
ASM_PADDED_MAX_PS_QLEN = 4  # largest qlen with a bf16 persistent gqa=16 kernel for a padded rank
FP8_PREFILL_TILE_Q = 256  # query rows per PS prefill tile (vLLM's _FP8_PREFILL_TILE_Q)
SEGMENTED_MAX_PAGE = 128  # cap of the segmented verify subpage (vLLM _segmented_mla_page_size)


@dataclasses.dataclass(frozen=True)
class ArchInfo:
    """Static facts about one AMD Instinct architecture.

    Attributes:
      name: ``"gfx942"`` (MI300X/MI325X) or ``"gfx950"`` (MI350/MI355X).
      num_cu: compute units of the flagship part (the planner's default CU count).
      fp8: jnp dtype name of the platform fp8 (``float8_e4m3fnuz`` on gfx942, ``_fn`` on gfx950).
      lds_bytes: LDS per CU (``maxSharedMemoryPerMultiProcessor``); the metadata planner's
        parallel variant must fit its per-batch scratch in it.
      gluon: the Gluon small-head MLA kernel exists (needs ~160 KiB LDS: gfx950 only).
      segmented: the segmented Triton decode is used for DCP verify (gated on Gluon, as vLLM).
      fp8_prefill_ps: vLLM enables the fp8 PS asm prefill (gated on gfx950).
    """

    name: str
    num_cu: int
    fp8: str
    lds_bytes: int
    gluon: bool
    segmented: bool
    fp8_prefill_ps: bool


ARCH_INFO = {
    "gfx942": ArchInfo("gfx942", 304, "float8_e4m3fnuz", 64 * 1024, False, False, False),
    "gfx950": ArchInfo("gfx950", 256, "float8_e4m3fn", 160 * 1024, True, True, True),
}


@dataclasses.dataclass(frozen=True)
class AiterBuild:
    """What the installed AITER build provides beyond the arch (vLLM probes these at runtime).

    Attributes:
      native_h24_reducer: ``reduce.cu`` instantiates a 24-head reducer (True at AITER HEAD).
      native_h24_metadata: the metadata planner accepts 24 heads (False at AITER HEAD).
      gluon_kernel: ``aiter.ops.triton.gluon.mla_gluon`` (or the legacy name) imports.
      segmented_kernel: ``aiter.ops.triton.attention.mla.mla_decode_fwd`` imports.
      fp8_prefill_kernels: ``aiter.mla_prefill_ps_asm_fwd`` and ``aiter.mla_reduce_v1`` import.
      asm_kernels: the asm decode kernels of one arch (:class:`AsmKernelSet`), derived from the
        installed AITER's ``mla_asm.csv``; ``None``: not given (``plan.make_plan`` then finds
        the installed set, the pure functions here use the static :data:`ASM_KERNELS`).
      version: the installed AITER's version (its ``amd-aiter`` distribution's, e.g.
        ``0.1.21.post1``; ``bridge.installed_version``); ``None``: unknown. Only the table of
        known-bad kernels reads it (``known_bad.py``), and there unknown counts as affected.
    """

    native_h24_reducer: bool = True
    native_h24_metadata: bool = False
    gluon_kernel: bool = True
    segmented_kernel: bool = True
    fp8_prefill_kernels: bool = True
    asm_kernels: AsmKernelSet | None = None
    version: str | None = None

    @property
    def native_h24(self) -> bool:
        """24 heads run unpadded only when both the reducer and the planner declare them."""
        return self.native_h24_reducer and self.native_h24_metadata


DEFAULT_BUILD = AiterBuild()


def arch_info(arch: str) -> ArchInfo:
    if arch not in ARCH_INFO:
        raise ValueError(f"arch={arch!r} is not one of {ARCHES}")
    return ARCH_INFO[arch]


def detect_arch(device=None) -> str | None:
    """``"gfx942"``/``"gfx950"`` for a ROCm jax device (default: the first device), else None.

    JAX reports the AMD target in ``device.compute_capability`` (e.g. ``"gfx942"``, possibly with
    feature suffixes such as ``":sramecc+:xnack-"``); CUDA devices report ``"9.0"`` and CPUs
    nothing, so this returns None off ROCm (tests pass ``arch`` explicitly).
    """
    if device is None:
        import jax

        try:
            device = jax.devices()[0]
        except RuntimeError:
            return None
    cc = str(getattr(device, "compute_capability", "") or "")
    if not cc.startswith("gfx"):
        return None
    name = cc.split(":")[0]
    return name if name in ARCH_INFO else None


def fp8_dtype(arch: str):
    """The platform fp8 jnp dtype: ``float8_e4m3fnuz`` (gfx942) or ``float8_e4m3fn`` (gfx950)."""
    return jnp.dtype(arch_info(arch).fp8)


def dtype_name(dtype) -> str:
    """``"bf16"``, ``"fp16"``, ``"fp32"`` or ``"fp8"`` for a jnp/numpy dtype (or a name)."""
    if isinstance(dtype, str) and dtype in ("bf16", "fp16", "fp32", "fp8"):
        return dtype
    dt = jnp.dtype(dtype)
    names = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16",
             jnp.dtype(jnp.float32): "fp32"}
    if dt in names:
        return names[dt]
    if dt.name.startswith("float8"):
        return "fp8"
    raise TypeError(f"dtype {dt} is not one AITER's MLA kernels know (bf16, fp16, fp32, fp8)")


def small_head_mode(mode: str | None = None) -> str:
    """The small-head mode: ``mode`` if given, else ``JAX_MLA_AITER_SMALL_HEAD_MODE``.

    How AITER serves fewer than 16 decode heads (vLLM's ``VLLM_ROCM_AITER_MLA_ASM_PADDING``):
    ``auto`` uses the Gluon kernel for divisors of 16 on gfx950 and padded asm otherwise,
    ``gluon`` uses Gluon wherever the arch has it, ``asm`` always pads to 16 for the asm kernel.
    """
    if mode is None:
        return env.read_choice("JAX_MLA_AITER_SMALL_HEAD_MODE", SMALL_HEAD_MODES, "auto")
    mode = str(mode).strip().lower()
    if mode not in SMALL_HEAD_MODES:
        raise ValueError(f"small-head mode {mode!r} must be one of {SMALL_HEAD_MODES}")
    return mode


# ---------------------------------------------------------------------------------------------
# Head rules (vLLM's AiterMLAHelper); padding itself lives in jax_mla.heads.


def actual_num_heads(n: int, build: AiterBuild = DEFAULT_BUILD) -> int:
    """Head count the asm decode kernel sees: ``ceil(n/16)*16``; 24 only on a native-H24 build."""
    return _heads.padded_num_heads(n, native_h24=build.native_h24)


def fp8_prefill_num_heads(n: int) -> int:
    """Head count of the fp8 PS prefill: always ``ceil(n/16)*16`` (no H24 carve-out)."""
    _heads.check_num_heads(n)
    return -(-int(n) // MIN_HEADS) * MIN_HEADS


def gluon_decode_supported(arch: str, build: AiterBuild = DEFAULT_BUILD) -> bool:
    """``_gluon_mla_decode_supported``: gfx950 (LDS) and a build that ships the kernel."""
    return arch_info(arch).gluon and build.gluon_kernel


def segmented_decode_supported(arch: str, build: AiterBuild = DEFAULT_BUILD) -> bool:
    """``_segmented_mla_decode_supported``: the Gluon gate and the segmented kernel importable."""
    return gluon_decode_supported(arch, build) and arch_info(arch).segmented and \
        build.segmented_kernel


def segmented_dcp_verify_supported(dcp_world_size: int, cp_interleave: int, arch: str,
                                   build: AiterBuild = DEFAULT_BUILD) -> bool:
    """(R:) ``dcp_world_size > 1 and cp_interleave == 1 and segmented decode supported``."""
    return dcp_world_size > 1 and cp_interleave == 1 and segmented_decode_supported(arch, build)


def fp8_prefill_supported(arch: str, build: AiterBuild = DEFAULT_BUILD) -> bool:
    """``_fp8_mla_prefill_supported``: gfx950 and the PS prefill + reducer kernels exported."""
    return arch_info(arch).fp8_prefill_ps and build.fp8_prefill_kernels


def segmented_page_size(block_size: int) -> int:
    """``min(128, largest power of two dividing block_size)``: 1->1, 16->16, 64->64, 1536->128."""
    block_size = int(block_size)
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return min(SEGMENTED_MAX_PAGE, block_size & -block_size)


_gluon_warned: set[str] = set()


def _warn_gluon_unavailable(arch: str) -> None:
    # vLLM warns once when "gluon" is requested on a build/arch without the kernel.
    if arch not in _gluon_warned:
        _gluon_warned.add(arch)
        warnings.warn(
            f"JAX_MLA_AITER_SMALL_HEAD_MODE=gluon but {arch} has no Gluon MLA kernel (gfx950 "
            "only); small-head decode falls back to padded asm",
            stacklevel=3,
        )


def use_gluon_decode(n_dec: int, max_qo_len: int, kv_dtype, *, arch: str,
                     build: AiterBuild = DEFAULT_BUILD, mode: str | None = None) -> bool:
    """vLLM's ``use_gluon_decode``: small-head (< 16) single-token bf16-KV decode on Gluon.

    False for ``n_dec >= 16``, ``max_qo_len != 1`` or an fp8 cache (checked before the mode:
    Gluon's fp8 regime asserts batch 1); mode ``asm`` -> False; ``gluon`` -> the arch gate;
    ``auto`` -> ``16 % n_dec == 0`` and the arch gate.
    """
    if n_dec >= MIN_HEADS or max_qo_len != 1:
        return False
    if dtype_name(kv_dtype) == "fp8":
        return False
    mode = small_head_mode(mode)
    if mode == "asm":
        return False
    supported = gluon_decode_supported(arch, build)
    if mode == "gluon":
        if not supported:
            _warn_gluon_unavailable(arch)
        return supported
    return MIN_HEADS % n_dec == 0 and supported


def use_gluon_verify(n_dec: int, max_qo_len: int, kv_dtype, dcp_world_size: int = 1, *,
                     arch: str, build: AiterBuild = DEFAULT_BUILD,
                     mode: str | None = None) -> bool:
    """vLLM's ``use_gluon_verify``: small-head multi-token bf16 verify on Gluon's 4-D MTP entry.

    False for ``max_qo_len <= 1``, DCP, an fp8 cache (fp8 has an asm kernel via the q-row fold),
    ``n_dec >= 16`` or no Gluon on the arch; otherwise ``mode != "asm"`` (bf16 has no gqa < 16,
    qlen > 1 asm kernel, so ``auto`` picks Gluon even for non-divisor counts).
    """
    if max_qo_len <= 1 or dcp_world_size > 1:
        return False
    if dtype_name(kv_dtype) == "fp8":
        return False
    if n_dec >= MIN_HEADS:
        return False
    if not gluon_decode_supported(arch, build):
        return False
    return small_head_mode(mode) != "asm"


def use_persistent_schedule(n_dec: int, max_qo_len: int, kv_dtype, mtp_decode_qlen: int, *,
                            gluon_decode: bool, gluon_verify: bool,
                            dcp_verify: bool = False) -> bool:
    """vLLM's persistent-schedule gate (docs/design.md §7.7).

    ``not gluon and (n_dec >= 16 or max_qo_len <= 4 or fp8 KV) and 1 <= max_qo_len <= K`` (and
    not the DCP-verify route, R:). The middle clause: a padded (< 16 head) bf16 rank has no
    persistent gqa=16 kernel above qlen 4, and fp8's fold to a persistent kernel rejects
    non-persistent mode.
    """
    if gluon_decode or gluon_verify or dcp_verify:
        return False
    kv_fp8 = dtype_name(kv_dtype) == "fp8"
    small_ok = n_dec >= MIN_HEADS or max_qo_len <= ASM_PADDED_MAX_PS_QLEN or kv_fp8
    return small_ok and 1 <= max_qo_len <= mtp_decode_qlen


# ---------------------------------------------------------------------------------------------
# Kernel availability tables (docs/design.md §7.8), as data.


@dataclasses.dataclass(frozen=True)
class AsmKernelRow:
    """One family of AITER asm decode kernels.

    Attributes:
      q, kv: dtype names.
      heads: kernel head counts (gqa, after the planner's fold); ``None`` = any count >= 16.
      qlens: query lengths served; ``None`` = any ``qlen >= qlen_min``.
      persistent: persistent (ps=1) or split-KV stage 1 + Triton stage 2.
      lse: ``True``/``False``/``None`` (unknown) -- can it return the final LSE?
    """

    q: str
    kv: str
    heads: tuple[int, ...] | None
    qlens: tuple[int, ...] | None
    persistent: bool
    lse: bool | None
    qlen_min: int = 1

    def serves_qlen(self, qlen: int) -> bool:
        return qlen in self.qlens if self.qlens is not None else qlen >= self.qlen_min


_Q4 = (1, 2, 3, 4)
_Q8 = tuple(range(1, 9))

# AITER's hsa/<arch>/mla/mla_asm.csv at AITER_COMMIT, read through asm_mla.cu's key rewrite
# (native.kernel_key): which (kernel heads, qlen) each mode serves. tests/test_aiter_kernel_set.py
# checks these tables equal the ones derived from that csv (native.kernel_set_from_table), so the
# two cannot drift. 8-head rows are facts of the csv that jax_mla never reaches (the asm route
# pads to 16 heads). Non-persistent LSE comes from the Triton stage 2: every such row has one.
ASM_KERNELS: dict[str, tuple[AsmKernelRow, ...]] = {
    "gfx942": (
        # Persistent: heads 32..128 are folded to 16 first, so qlen > 4 has no bf16 kernel.
        # The qseqlen4 kernels serve qlen 1..4 (AITER pads the query length).
        AsmKernelRow("bf16", "bf16", (16,), _Q4, True, False),
        AsmKernelRow("bf16", "bf16", (8,), (2,), True, False),  # subQ16_mqa16_ps (AITER: native)
        AsmKernelRow("bf16", "fp8", (16,), _Q4, True, False),
        AsmKernelRow("fp8", "fp8", (16,), _Q4, True, False),
        AsmKernelRow("fp8", "fp8", (64,), (1,), True, True),  # the only persistent LSE on gfx942
        AsmKernelRow("fp8", "fp8", (128,), None, True, False),
        AsmKernelRow("bf16", "bf16", (16,), _Q8, False, True),
        # 64 heads at qlen 1 key the qseqlen1 gqa64 kernel, which only gfx950 ships.
        AsmKernelRow("bf16", "bf16", (32, 128), None, False, True),
        AsmKernelRow("bf16", "bf16", (64,), None, False, True, qlen_min=2),
        AsmKernelRow("bf16", "bf16", (8,), (1,), False, True),  # qlen 2 is gfx950's
        AsmKernelRow("fp8", "fp8", (16,), _Q4, False, True),  # qlen 3 runs the qseqlen4 kernel
        AsmKernelRow("fp8", "fp8", (128,), None, False, True),
        AsmKernelRow("fp8", "fp8", (8,), (1,), False, True),
    ),
    "gfx950": (
        # bf16 persistent: every head count >= 16 runs natively on two generic kernels (qh32-
        # qseqlen4 / qh64-qseqlen1, s_MQA = gqa), both with LSE variants; 8 heads reach them
        # from qlen 8 (gqa * qlen >= 64).
        AsmKernelRow("bf16", "bf16", None, None, True, True),
        AsmKernelRow("bf16", "bf16", (8,), None, True, True, qlen_min=8),
        AsmKernelRow("bf16", "fp8", (16,), _Q4, True, False),
        # fp8 persistent: the qseqlen4 / qseqlen1 16/32 kernels carry LSE variants; gqa16 qlen 2
        # has none.
        AsmKernelRow("fp8", "fp8", (16,), (1,), True, True),
        AsmKernelRow("fp8", "fp8", (16,), (2,), True, False),
        AsmKernelRow("fp8", "fp8", (16,), None, True, True, qlen_min=3),
        AsmKernelRow("fp8", "fp8", (32, 64, 128), None, True, True),
        AsmKernelRow("fp8", "fp8", (8,), (4,), True, True),
        AsmKernelRow("bf16", "bf16", (16,), _Q8, False, True),
        AsmKernelRow("bf16", "bf16", (32, 64, 128), None, False, True),
        AsmKernelRow("bf16", "bf16", (8,), (1, 2), False, True),
        AsmKernelRow("fp8", "fp8", (16,), _Q4, False, True),  # qlen 3 runs the qseqlen4 kernel
        AsmKernelRow("fp8", "fp8", (128,), None, False, True),
        AsmKernelRow("fp8", "fp8", (8,), (1,), False, True),
    ),
}

# The domain a kernel set is derived over and compared on: every head count AITER's reducer is
# built for, every dtype pair of bf16/fp8, qlen 1..32. AITER's key rewrite compares qlen with
# constants up to 8 and gqa * qlen with 64 and 128 (qlen 16 at 8 heads), so above 16 every qlen
# takes the same key: a family served at qlen 32 serves every larger qlen.
KERNEL_SET_HEADS = (8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
KERNEL_SET_DTYPES = (("bf16", "bf16"), ("bf16", "fp8"), ("fp8", "fp8"), ("fp8", "bf16"))
KERNEL_SET_MAX_QLEN = 32


@dataclasses.dataclass(frozen=True)
class AsmKernelSet:
    """The asm decode kernels of one arch, as :class:`AsmKernelRow` rows, and their origin.

    Attributes:
      arch: the arch the rows are for.
      rows: the availability rows (the static :data:`ASM_KERNELS` entry, or derived from an
        installed ``mla_asm.csv`` by ``native.kernel_set_from_table``).
      source: where they come from, for messages (the csv's path, or the static table and why).
      installed: derived from an installed AITER (False: the static table).
    """

    arch: str
    rows: tuple[AsmKernelRow, ...] = dataclasses.field(repr=False)
    source: str = ""
    installed: bool = False


def static_kernel_set(arch: str, why: str = "no kernel set given") -> AsmKernelSet:
    """The static table of ``arch`` (ROCm/aiter :data:`AITER_COMMIT`), saying ``why`` it is used."""
    name = arch_info(arch).name
    return AsmKernelSet(name, ASM_KERNELS[name],
                        f"the static table (ROCm/aiter {AITER_COMMIT[:8]}'s hsa/{name}/mla/"
                        f"mla_asm.csv): {why}", installed=False)


def resolve_kernel_set(arch: str, kernels: AsmKernelSet | None = None) -> AsmKernelSet:
    """``kernels`` (checked to be ``arch``'s), else the static table of ``arch``."""
    if kernels is None:
        return static_kernel_set(arch)
    if kernels.arch != arch_info(arch).name:
        raise ValueError(f"the asm kernel set is {kernels.arch}'s ({kernels.source}), but the "
                         f"plan is for {arch}")
    return kernels


def asm_kernel_facts(rows) -> dict[tuple, bool | None]:
    """``{(q, kv, kernel heads, qlen, persistent): lse}`` for every shape ``rows`` serve on the
    :data:`KERNEL_SET_HEADS` x :data:`KERNEL_SET_DTYPES` x qlen 1..:data:`KERNEL_SET_MAX_QLEN`
    domain (``lse``: whether it can also return the LSE; ``None`` unknown). Two tables are the
    same kernel set when their facts are equal, however their rows are grouped."""
    facts = {}
    for (q, kv), ps, h, qlen in itertools.product(
            KERNEL_SET_DTYPES, (True, False), KERNEL_SET_HEADS,
            range(1, KERNEL_SET_MAX_QLEN + 1)):
        if asm_kernel_served(rows, q, kv, h, qlen, persistent=ps):
            facts[(q, kv, h, qlen, ps)] = asm_kernel_served(rows, q, kv, h, qlen, persistent=ps,
                                                            lse=True)
    return facts


def rows_from_facts(facts: dict[tuple, bool | None]) -> tuple[AsmKernelRow, ...]:
    """The :class:`AsmKernelRow` rows of a fact map (:func:`asm_kernel_facts`'s form).

    Query lengths served up to :data:`KERNEL_SET_MAX_QLEN` become ``qlens=None`` from the start
    of that run; head counts with the same rows are grouped, and every count >= 16 of the
    domain becomes ``heads=None``. ``asm_kernel_facts(rows_from_facts(f)) == f``.
    """
    big = tuple(h for h in KERNEL_SET_HEADS if h >= MIN_HEADS)
    out = []
    for (q, kv), ps in itertools.product(KERNEL_SET_DTYPES, (True, False)):
        by_sig: dict[tuple, list[int]] = {}
        for h in KERNEL_SET_HEADS:
            served = {ql: facts[(q, kv, h, ql, ps)] for ql in range(1, KERNEL_SET_MAX_QLEN + 1)
                      if (q, kv, h, ql, ps) in facts}
            if not served:
                continue
            sig = []
            for lse in sorted({v for v in served.values()}, key=repr):
                qls = sorted(ql for ql, v in served.items() if v is lse)
                tail = KERNEL_SET_MAX_QLEN + 1
                while tail - 1 in qls:
                    tail -= 1
                head = tuple(ql for ql in qls if ql < tail)
                if tail <= KERNEL_SET_MAX_QLEN:
                    sig.append((None, tail, lse))
                if head:
                    sig.append((head, 1, lse))
            by_sig.setdefault(tuple(sig), []).append(h)
        for sig, hs in by_sig.items():
            groups = [hs]
            if set(big) <= set(hs):
                groups = [None] + ([tuple(h for h in hs if h < MIN_HEADS)]
                                   if len(hs) > len(big) else [])
            for heads in groups:
                for qlens, qmin, lse in sig:
                    out.append(AsmKernelRow(q, kv, None if heads is None else tuple(heads),
                                            qlens, ps, lse, qlen_min=qmin))
    return tuple(out)


def planner_natively_supported(arch: str, num_heads: int, q_dtype, kv_dtype,
                               max_seqlen_qo: int) -> bool:
    """AITER metadata planner's "natively supported" predicate (non-experimental builds).

    ``heads == 16`` or (fp8 q&kv, 64 heads, qlen 1) or (gfx950, bf16 q&kv) or (gfx942, fp8, 128)
    or (gfx950, fp8, heads in {32, 64, 128}). Otherwise a multiple of 16 is folded to 16-head
    pseudo-batches. ``mla_decode_fwd``'s persistent path folds under the same rule.
    """
    q8 = dtype_name(q_dtype) == "fp8"
    kv8 = dtype_name(kv_dtype) == "fp8"
    h = int(num_heads)
    return (
        h == 16
        or (h == 64 and q8 and kv8 and max_seqlen_qo == 1)
        or (arch == "gfx950" and not q8 and not kv8)
        or (arch == "gfx942" and h == 128 and q8 and kv8)
        or (arch == "gfx950" and q8 and kv8 and h in (32, 64, 128))
    )


def fold_ratio(arch: str, num_heads: int, q_dtype, kv_dtype, max_seqlen_qo: int, *,
               force_fold: bool = False) -> int:
    """How many 16-head pseudo-batches one request becomes in persistent mode (1 = no fold).

    ``force_fold``: fold a count AITER serves natively too (its native kernel is known bad,
    ``known_bad.py``). Raises ``ValueError`` where AITER has neither a native kernel nor a fold
    (its AITER_CHECK).
    """
    h = int(num_heads)
    if h == MIN_HEADS or (not force_fold and planner_natively_supported(
            arch, h, q_dtype, kv_dtype, max_seqlen_qo)):
        return 1
    if h % 16 == 0 and 32 <= h <= 128:
        return h // 16
    raise ValueError(
        f"AITER's persistent MLA decode has no kernel for {h} heads on {arch} with q "
        f"{dtype_name(q_dtype)} / kv {dtype_name(kv_dtype)} (only 16..128 in steps of 16 fold, "
        "and 24 is native only for bf16 on gfx950)"
    )


def asm_kernel_served(rows, q: str, kv: str, kernel_heads: int, qlen: int, *,
                      persistent: bool, lse: bool = False) -> bool | None:
    """Whether one of ``rows`` serves exactly this kernel shape (no folding): ``True``,
    ``False`` or ``None`` (served, but its LSE support is unknown)."""
    h = int(kernel_heads)
    best: bool | None = False
    for row in rows:
        if row.persistent != persistent or row.q != q or row.kv != kv:
            continue
        if row.heads is None and h < MIN_HEADS:
            continue
        if row.heads is not None and h not in row.heads:
            continue
        if not row.serves_qlen(qlen):
            continue
        if not lse:
            return True
        if row.lse:
            return True
        if row.lse is None:
            best = None
    return best


def asm_kernel_available(arch: str, q_dtype, kv_dtype, num_heads: int, qlen: int, *,
                         persistent: bool, lse: bool = False,
                         kernels: AsmKernelSet | None = None,
                         force_fold: bool = False) -> bool | None:
    """Whether an asm decode kernel serves this shape: ``True``, ``False`` or ``None`` (unknown).

    ``num_heads`` is what the caller passes (the padded count); in persistent mode it is first
    folded like AITER does (``force_fold``: folded even where AITER serves it natively).
    Non-persistent mode never folds. ``kernels``: the kernel set to consult (default: the
    static table of ``arch``).
    """
    q, kv = dtype_name(q_dtype), dtype_name(kv_dtype)
    h = int(num_heads)
    if persistent:
        try:
            ratio = fold_ratio(arch, h, q, kv, qlen, force_fold=force_fold)
        except ValueError:
            return False
        h = 16 if ratio > 1 else h
    kernels = resolve_kernel_set(arch, kernels)
    return asm_kernel_served(kernels.rows, q, kv, h, qlen, persistent=persistent, lse=lse)


# ---------------------------------------------------------------------------------------------
# The routing decision, carried in the metadata.

ROUTES = ("asm", "gluon_decode", "gluon_verify", "dcp_verify")


@dataclasses.dataclass(frozen=True)
class AiterRoute:
    """The builder's decision for one decode/verify step (static, hashable).

    Attributes:
      kind: ``"asm"``, ``"gluon_decode"``, ``"gluon_verify"`` or ``"dcp_verify"``.
      arch: target arch.
      num_heads: ``n_dec``, the query heads of the call (``H * N`` under DCP).
      kernel_heads: heads the kernel is called with: padded for asm, ``n_dec`` otherwise.
      qlen: query tokens per request (``max_qo_len`` after uniform-MTP padding).
      persistent: the persistent split-KV schedule is built and passed (asm only).
      zero_fill: the asm output is zero-filled first (qlen > 1 without a persistent schedule).
      return_lse: the kernel is asked for the natural-log LSE.
      q_dtype, kv_dtype: dtype names the kernels are planned for.
      dcp_world_size: ``N``.
      num_cu: CU count the persistent schedule is planned for.
      mtp_decode_qlen: ``K``, the largest qlen decode is handed (sizes the plan).
      asm_kernels: the asm kernel set the route is checked against (:func:`check_route_kernels`):
        the installed AITER's or the static table, with its source.
      force_fold: the persistent plan folds the heads into 16-head pseudo-batches although
        AITER serves the count natively, because that native kernel is known bad (``avoided``).
      avoided: the known-bad kernels (``known_bad.KnownBadKernel`` rows) this route goes around,
        with the replacement each names; empty for the route vLLM would take.
      known_bad_allowed: known-bad kernels this route launches anyway, because the override
        (``JAX_MLA_AITER_ALLOW_KNOWN_BAD`` or ``allow_known_bad=``) allows them.
    """

    kind: str
    arch: str
    num_heads: int
    kernel_heads: int
    qlen: int
    persistent: bool
    zero_fill: bool
    return_lse: bool
    q_dtype: str
    kv_dtype: str
    dcp_world_size: int = 1
    num_cu: int = 0
    mtp_decode_qlen: int = 1
    asm_kernels: AsmKernelSet | None = None
    force_fold: bool = False
    avoided: tuple = ()  # of known_bad.KnownBadKernel (known_bad reads this module)
    known_bad_allowed: tuple = ()

    @property
    def notes(self) -> tuple[str, ...]:
        """One sentence per known-bad kernel the route goes around or, by override, runs."""
        return (tuple(row.avoided_note() for row in self.avoided)
                + tuple(row.allowed_note() for row in self.known_bad_allowed))


def decide_route(*, arch: str, num_heads: int, qlen: int, q_dtype, kv_dtype,
                 dcp_world_size: int = 1, cp_interleave: int = 1,
                 mtp_decode_qlen: int | None = None, return_lse: bool | None = None,
                 num_cu: int | None = None, build: AiterBuild = DEFAULT_BUILD,
                 mode: str | None = None) -> AiterRoute:
    """Route a decode/verify step exactly as vLLM's builder + ``forward_mqa`` do.

    Order (vLLM's ``forward_mqa``): Gluon decode, Gluon verify, segmented DCP verify; a DCP
    multi-token step without the segmented route raises (vLLM raises in forward; deciding
    once means raising here); everything else is asm decode, persistent when the gate holds.

    Args:
      num_heads: ``n_dec`` = per-rank heads times ``dcp_world_size`` (the gathered query heads).
      qlen: uniform query length (after uniform-MTP padding).
      mtp_decode_qlen: ``K`` (default ``qlen``); a step with ``qlen > K`` runs non-persistent.
      return_lse: ask the kernel for the LSE (default: ``dcp_world_size > 1``, as vLLM).
        Gluon returns one when asked (a later vLLM revision's fix: vLLM hands a DCP combine
        ``None`` there).
      build: the AITER build; its ``asm_kernels`` (default: the static table of ``arch``) is the
        kernel set the route carries and :func:`check_route_kernels` checks it against.
    """
    info = arch_info(arch)
    n = int(num_heads)
    _heads.check_num_heads(n, "num_heads (decode heads, H * dcp_world_size)")
    qlen, dcp = int(qlen), int(dcp_world_size)
    if qlen < 1 or dcp < 1:
        raise ValueError(f"qlen={qlen} and dcp_world_size={dcp} must be >= 1")
    # K < qlen is legal: vLLM's gate then refuses the persistent plan (sized for K).
    k = qlen if mtp_decode_qlen is None else int(mtp_decode_qlen)
    if k < 1:
        raise ValueError(f"mtp_decode_qlen={k} must be >= 1")
    lse = dcp > 1 if return_lse is None else bool(return_lse)
    q, kv = dtype_name(q_dtype), dtype_name(kv_dtype)
    cu = info.num_cu if num_cu is None else int(num_cu)
    common = dict(arch=arch, num_heads=n, qlen=qlen, return_lse=lse, q_dtype=q, kv_dtype=kv,
                  dcp_world_size=dcp, num_cu=cu, mtp_decode_qlen=k,
                  asm_kernels=resolve_kernel_set(arch, build.asm_kernels))

    if use_gluon_decode(n, qlen, kv, arch=arch, build=build, mode=mode):
        return AiterRoute("gluon_decode", kernel_heads=n, persistent=False, zero_fill=False,
                          **common)
    if use_gluon_verify(n, qlen, kv, dcp, arch=arch, build=build, mode=mode):
        return AiterRoute("gluon_verify", kernel_heads=n, persistent=False, zero_fill=False,
                          **common)
    if segmented_dcp_verify_supported(dcp, cp_interleave, arch, build) and qlen > 1:
        return AiterRoute("dcp_verify", kernel_heads=n, persistent=False, zero_fill=False,
                          **{**common, "return_lse": True})
    if dcp > 1 and qlen > 1:
        raise RuntimeError(
            "ROCM_AITER_MLA DCP multi-token verify requires segmented MLA (gfx950, "
            f"cp_interleave == 1 and the segmented kernel); got {arch}, cp_interleave="
            f"{cp_interleave}. Route verify tokens through prefill instead."
        )
    persistent = use_persistent_schedule(n, qlen, kv, k, gluon_decode=False,
                                         gluon_verify=False)
    return AiterRoute("asm", kernel_heads=actual_num_heads(n, build), persistent=persistent,
                      zero_fill=qlen > 1 and not persistent, **common)


def check_route_kernels(route: AiterRoute) -> None:
    """Raise ``NotImplementedError`` where the route's kernel set (``route.asm_kernels``: the
    installed AITER's, else the static table, docs/design.md §7.8) has *no* kernel for it.

    The message names the missing kernel (arch, dtypes, heads, qlen, persistent or not, LSE)
    and the table that lacks it. Unknown table entries pass (AITER itself is the judge there).
    Gluon and the segmented kernel take any head count below 16 / any count respectively.
    """
    if route.kind != "asm":
        if route.kind in ("gluon_decode", "gluon_verify") and route.kv_dtype == "fp8":
            raise NotImplementedError("Gluon routes are bf16-KV only")
        return
    if route.q_dtype not in ("bf16", "fp8"):
        raise NotImplementedError(
            f"AITER's asm MLA decode takes a bf16 or fp8 query, got {route.q_dtype} (fp16 models "
            "fail the asm path in vLLM too)"
        )
    kernels = resolve_kernel_set(route.arch, route.asm_kernels)
    ok = asm_kernel_available(route.arch, route.q_dtype, route.kv_dtype, route.kernel_heads,
                              route.qlen, persistent=route.persistent, lse=route.return_lse,
                              kernels=kernels, force_fold=route.force_fold)
    if ok is not False:
        return
    mode = "persistent" if route.persistent else "non-persistent"
    heads = f"{route.kernel_heads} heads"
    if route.persistent:
        try:
            ratio = fold_ratio(route.arch, route.kernel_heads, route.q_dtype, route.kv_dtype,
                               route.qlen, force_fold=route.force_fold)
        except ValueError:
            ratio = 1
        if ratio > 1:
            heads += f" (run as {ratio} 16-head pseudo-batches)"
    why = "AITER would fail with 'cannot get heuristic kernel'"
    if kernels.installed:
        pinned = asm_kernel_available(route.arch, route.q_dtype, route.kv_dtype,
                                      route.kernel_heads, route.qlen,
                                      persistent=route.persistent, lse=route.return_lse,
                                      force_fold=route.force_fold)
        if pinned is not False:
            why += (f"; ROCm/aiter {AITER_COMMIT[:8]} has this kernel: the installed AITER's "
                    "kernel set differs from the one jax_mla was written against")
    for row in route.avoided:
        why += f"; {row.avoided_note()}"
    raise NotImplementedError(
        f"AITER on {route.arch} has no {mode} asm MLA decode kernel for q {route.q_dtype} / "
        f"kv {route.kv_dtype}, {heads}, qlen {route.qlen}"
        + (" that returns an LSE" if route.return_lse else "")
        + f" in {kernels.source} (docs/design.md §7.8); {why}"
    )
