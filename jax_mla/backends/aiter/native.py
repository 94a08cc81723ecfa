"""AITER's asm MLA decode through jax_mla's own launcher: no torch, no Python per call.

The asm decode kernels (stage 1 of AITER's ``mla_decode_fwd``, persistent and split-KV) are
assembly code objects (``.co``) that AITER ships under ``hsa/<arch>/mla/`` with a kernel table,
``mla_asm.csv``. Here they are launched by jax_mla's typed XLA FFI handler
``jax_mla_aiter_asm_mla`` (``ffi/aiter_asm.cc``), which loads the ``.co`` with ``hipModuleLoad``
at its first call and launches it on XLA's stream with jax_mla's own copy of the kernels'
argument block (:data:`KERNEL_ARGS_LAYOUT`, read from ROCm/aiter at :data:`AITER_COMMIT`).
The split merge (stage 2) is jnp: AITER's ``mla_reduce_v1`` semantics for a persistent plan
(``planner.reduce_plan_reference``) and its Triton ``_fwd_kernel_stage2_asm`` merge otherwise.

What happens once, at trace time, in Python: finding the installed AITER's ``hsa`` directory
(:func:`asm_dir`, without importing ``aiter`` or torch), reading and checking its kernel table
(:func:`kernel_table`: an install whose table does not have the columns and kernel-name form
of the pinned commit is refused with :class:`AiterInstallError`), choosing the kernel by AITER's
own rules (:func:`select_kernel`, a port of ``mla_decode_stage1_asm_fwd``'s key rewrite at the
pinned commit) and registering the handlers. Once per installation, the same table becomes the
kernel set routing checks against (:func:`installed_kernel_set`, read at plan build). Nothing
here runs per call: the custom call's attributes carry the ``.co`` path, the kernel name and the
scalars, and every buffer (the persistent work-metadata pointer pair included) is an XLA operand
or result, so no host sync.

``backend.py`` uses this route on ROCm when :func:`unavailable_reason` is None and falls back to
the Python bridge (``bridge.asm_decode``) otherwise, with one warning per process.
Nothing here has run on AMD hardware.
"""

from __future__ import annotations

import csv
import ctypes
import dataclasses
import functools
import importlib.util
import itertools
import logging
import os
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import heads as _heads
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.aiter.planner import fold_rows, reduce_plan_reference, unfold_rows
from jax_mla.backends.base import out_dtype

log = logging.getLogger(__name__)

# The ROCm/aiter commit the argument block, the kernel table's form and the selection rules were
# read from (csrc/py_itfs_cu/asm_mla.cu, hsa/gfx94{2}/gfx950/mla/mla_asm.csv, aiter/mla.py).
AITER_COMMIT = caps.AITER_COMMIT

TARGET_NAME = "jax_mla_aiter_asm_mla"  # ROCm: execute (load the .co once, launch)
PACK_TARGET_NAME = "jax_mla_aiter_asm_pack"  # CPU twin: writes the packed argument block

# ``MlaAsmKernelArgs`` (ffi/aiter_asm.cc): (field, byte offset, kind). Every field has a 16-byte
# slot; ``ptr`` is 8 bytes, ``f32``/``u32`` 4, the rest of each slot is zero padding.
KERNEL_ARGS_LAYOUT = (
    ("ptr_R", 0x00, "ptr"), ("ptr_LSE", 0x10, "ptr"), ("ptr_Q", 0x20, "ptr"),
    ("ptr_KV", 0x30, "ptr"), ("ptr_LTP", 0x40, "ptr"), ("ptr_LTD", 0x50, "ptr"),
    ("ptr_LTL", 0x60, "ptr"), ("scalar", 0x70, "f32"), ("s_MQA", 0x80, "u32"),
    ("s_kv_split", 0x90, "u32"), ("s_Q_Bs", 0xA0, "u32"), ("s_Bs", 0xB0, "u32"),
    ("s_log2_plen", 0xC0, "u32"), ("ptr_QTP", 0xD0, "ptr"), ("ptr_STP", 0xE0, "ptr"),
    ("ptr_RP", 0xF0, "ptr"), ("ptr_QSCALE", 0x100, "ptr"), ("ptr_KVSCALE", 0x110, "ptr"),
    ("out_16_nosplit", 0x120, "u32"), ("ptr_LSEP", 0x130, "ptr"), ("ptr_GKVTP", 0x140, "ptr"),
    ("s_cp_world_size", 0x150, "u32"), ("s_cp_rank", 0x160, "u32"),
)
KERNEL_ARGS_SIZE = 0x170  # 368 bytes
PACK_BYTES = KERNEL_ARGS_SIZE + 6 * 4  # the twin appends grid xyz and block xyz (uint32)
BLOCK_THREADS = 256

# mla_asm.csv at the pinned commit: gfx942 without ``cprr``, gfx950 with it.
CSV_COLUMNS = ("qType", "kvType", "Gqa", "ps", "qSeqLen", "prefill", "causal", "lse",
               "knl_name", "co_name")
CSV_OPTIONAL = ("cprr",)
_MANGLED = re.compile(r"_ZN5aiter(\d+)(\w+)E")


class AiterInstallError(RuntimeError):
    """The installed AITER's asm kernels are missing or not the ones jax_mla was written for."""


# --- finding the installed AITER's code objects -----------------------------------------------

def asm_dir() -> str | None:
    """AITER's ``hsa`` directory (which holds ``<arch>/mla/mla_asm.csv``), or None.

    In order: ``$AITER_ASM_DIR`` (AITER's own variable: the base, without the arch), the
    installed ``aiter_meta/hsa`` (non-editable installs), ``hsa/`` beside an editable ``aiter``
    package. Nothing is imported.
    """
    explicit = os.environ.get("AITER_ASM_DIR", "").strip()
    if explicit:
        return explicit
    candidates = []
    for name in ("aiter_meta", "aiter"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        for loc in spec.submodule_search_locations or ():
            candidates.append(os.path.join(loc, "hsa"))
            candidates.append(os.path.join(os.path.dirname(loc), "aiter_meta", "hsa"))
            candidates.append(os.path.join(os.path.dirname(loc), "hsa"))
    for c in candidates:
        if os.path.isdir(c):
            return c
    return None


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """One arch's ``mla_asm.csv``: its path and rows (dicts of the csv's columns)."""

    path: str
    rows: tuple

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path)


def hsa_base(base: str | None = None) -> str:
    """``base``, else the installed AITER's ``hsa`` directory (:func:`asm_dir`); refused when
    there is none."""
    base = base or asm_dir()
    if base is None:
        raise AiterInstallError(
            "jax_mla found no AITER asm kernels: set AITER_ASM_DIR to AITER's hsa/ directory, or "
            "install aiter (its aiter_meta/hsa)")
    return base


def kernel_table(arch: str, base: str | None = None) -> KernelTable:
    """The checked kernel table of ``arch`` under ``base`` (default :func:`asm_dir`)."""
    return _read_table(os.path.join(hsa_base(base), arch, "mla", "mla_asm.csv"))


@functools.cache
def _read_table(path: str, columns: tuple = CSV_COLUMNS, optional: tuple = CSV_OPTIONAL,
                ints: tuple = ("Gqa", "ps", "qSeqLen", "prefill", "causal", "lse"),
                what: str = "asm MLA kernel table") -> KernelTable:
    """A kernel table (``mla_asm.csv`` by default; native_fmha.py reads ``fmha_fwd.csv`` with
    its own ``columns`` and integer columns ``ints``), refused unless it has the pinned form."""
    if not os.path.isfile(path):
        raise AiterInstallError(f"AITER's {what} {path} does not exist")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        cols = tuple(c.strip() for c in reader.fieldnames or ())
        rows = tuple({k.strip(): (v or "").strip() for k, v in r.items() if k} for r in reader)
    missing = [c for c in columns if c not in cols]
    extra = [c for c in cols if c not in columns + optional]
    if missing or extra:
        raise AiterInstallError(
            f"AITER's kernel table {path} is not the one jax_mla reads (ROCm/aiter "
            f"{AITER_COMMIT[:8]}): columns {list(cols)}"
            + (f"; missing {missing}" if missing else "") + (f"; unknown {extra}" if extra else "")
            + f". Install an AITER whose {os.path.basename(path)} matches, or use the Python "
            "bridge")
    for i, r in enumerate(rows, start=2):
        # The length in the mangled name is not checked: AITER's own table has a symbol whose
        # length disagrees (gfx942 mla_a8w8_qh8_qseqlen1_gqaratio8_v1); the code-object check
        # (check_code_object) is what verifies the symbol.
        bad = _MANGLED.fullmatch(r["knl_name"]) is None or not r["co_name"].endswith(".co")
        try:
            for c in ints:
                int(r[c] or 0)
        except ValueError:
            bad = True
        if bad:
            raise AiterInstallError(
                f"AITER's kernel table {path}, line {i}, is not of the form jax_mla reads "
                f"(ROCm/aiter {AITER_COMMIT[:8]}: integer keys, knl_name '_ZN5aiter<n><name>E', "
                f"co_name '<file>.co'): {r}")
    return KernelTable(path, rows)


# --- what a code object declares (its AMDGPU metadata note) ----------------------------------

def code_object_kernels(path: str) -> dict:
    """``{kernel name: metadata}`` from a code object's ``NT_AMDGPU_METADATA`` note (the
    ``amdhsa.kernels`` entries: ``.args``, ``.kernarg_segment_size``, ...), a MessagePack map."""
    import struct

    import msgpack  # jax_mla[rocm]

    with open(path, "rb") as f:
        elf = f.read()
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    for k in range(shnum):
        sh = shoff + k * shentsize
        sh_type, = struct.unpack_from("<I", elf, sh + 4)
        if sh_type != 7:  # SHT_NOTE
            continue
        off, size = struct.unpack_from("<QQ", elf, sh + 0x18)
        j = off
        while j + 12 <= off + size:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, j)
            name = elf[j + 12:j + 12 + namesz].rstrip(b"\0")
            desc = j + 12 + (namesz + 3) // 4 * 4
            if ntype == 32 and name == b"AMDGPU":  # NT_AMDGPU_METADATA
                meta = msgpack.unpackb(elf[desc:desc + descsz], raw=False,
                                       strict_map_key=False)
                return {kn.get(".name"): kn for kn in meta.get("amdhsa.kernels", [])}
            j = desc + (descsz + 3) // 4 * 4
    raise ValueError("no AMDGPU metadata note")


@functools.cache
def check_code_object(path: str, kernel_name: str, layout=KERNEL_ARGS_LAYOUT,
                      size: int = KERNEL_ARGS_SIZE) -> None:
    """Refuse a ``.co`` that does not define ``kernel_name`` or whose declared arguments do not
    fit ``layout`` (default :data:`KERNEL_ARGS_LAYOUT`, ``size`` bytes): every named argument
    must start in one of our 16-byte slots and be at most 8 bytes, or be one raw view of the
    block's first N bytes (N <= ``size``, a multiple of 16); AITER's ``pad`` entries are
    ignored. At the pinned commit every decode kernel of gfx942 and gfx950 passes (checked
    against all of their ``.co`` files)."""
    try:
        kernels = code_object_kernels(path)
    except ImportError as e:
        raise AiterInstallError(f"checking AITER's code object {path} needs msgpack (pip install "
                                f"'jax_mla[rocm]')") from e
    except (OSError, ValueError, IndexError, UnicodeDecodeError) as e:  # msgpack: ValueErrors
        raise AiterInstallError(f"AITER's code object {path} cannot be read as an AMDGPU code "
                                f"object ({e})") from e
    if kernel_name not in kernels:
        raise AiterInstallError(f"AITER's code object {path} does not define {kernel_name} "
                                f"(it defines {sorted(k for k in kernels if k)})")
    slots = {off for _, off, _ in layout}

    def fits(a):
        off, width = a.get(".offset", -1), a.get(".size", 0)
        if off == 0 and width > 8:  # one raw view of the block's head (gfx942 a8w8 qh64)
            return width <= size and width % 16 == 0
        return off in slots and width <= 8

    bad = [(a.get(".name"), a.get(".offset"), a.get(".size"))
           for a in kernels[kernel_name].get(".args", [])
           if a.get(".name") != "pad" and not fits(a)]
    if bad:
        raise AiterInstallError(
            f"{kernel_name} in {path} declares arguments outside the argument block jax_mla "
            f"packs (ROCm/aiter {AITER_COMMIT[:8]}: {len(layout)} fields in 16-byte slots, "
            f"{size} bytes): "
            f"{bad}. Install an AITER whose asm MLA kernels match, or use the Python bridge")


# --- choosing the kernel (asm_mla.cu's mla_decode_stage1_asm_fwd at the pinned commit) --------

@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The asm kernel for one call: its symbol, its ``.co``, and the launch values it implies.

    ``sub_q``: query rows per workgroup (split-KV grid x); ``s_mqa``: the ``s_MQA`` argument;
    ``key``: the table key it was found under.
    """

    kernel_name: str
    co_path: str
    sub_q: int
    s_mqa: int
    key: tuple


def kernel_key(*, arch: str, q_type: str, kv_type: str, gqa: int, qlen: int, persistent: bool,
               lse: bool, cprr: bool = False, causal: bool = True) -> tuple[dict, int, int]:
    """AITER's table key for a call, with ``sub_q`` and ``s_mqa``: ``(key, sub_q, s_mqa)``.

    Our transcription of the ~130-line key rewrite in ``mla_decode_stage1_asm_fwd``
    (ROCm/aiter :data:`AITER_COMMIT`): pads ``qSeqLen``, chooses ``sub_Q`` and on gfx950 maps
    several (gqa, qlen) pairs onto generic kernels with ``s_MQA = gqa``. Raises
    ``NotImplementedError`` where AITER fails its own check.
    """
    bf16 = q_type == "bf16" and kv_type == "bf16"
    fp8 = q_type == "fp8" and kv_type == "fp8"
    ps = int(persistent)
    cfg_causal = 1 if qlen == 1 else int(causal)
    cfg_q, cfg_g, sub_q, s_mqa = qlen, gqa, 128, gqa * qlen

    def refuse(why):
        raise NotImplementedError(f"AITER's asm MLA decode ({arch}, q {q_type}, kv {kv_type}, "
                                  f"gqa {gqa}, qlen {qlen}, persistent {persistent}): {why}")

    if gqa == 128:
        cfg_q = 0
        if bf16 and arch == "gfx942":
            ps = 0
    elif gqa == 16:
        if bf16:
            if persistent:
                cfg_q = 4 if qlen <= 4 else cfg_q
            elif qlen == 1:
                cfg_q, sub_q = 1, 16
            else:
                cfg_q = 4 if qlen <= 4 else 8
        elif q_type == "bf16" and kv_type in ("fp8", "byte"):
            if persistent and qlen <= 4:
                cfg_q = 4
        elif q_type == "fp8":
            if qlen in (1, 2):
                cfg_q = qlen
            elif qlen <= 4:
                cfg_q, sub_q = 4, 64
            elif persistent and arch == "gfx950":
                cfg_q, cfg_g, s_mqa = 4, 32, gqa
            else:
                refuse("fp8 gqa 16 runs qlen <= 4, or qlen > 4 persistent on gfx950")
    elif gqa == 32:
        if bf16:
            if not persistent:
                cfg_q, sub_q = 0, 64
        elif fp8:
            if qlen == 1 and not persistent:
                cfg_q, sub_q = 1, 32
            elif qlen >= 3 and persistent and arch == "gfx950":
                cfg_q, sub_q = 4, 128
            elif qlen == 2 and persistent:
                cfg_q, sub_q = 2, 128
            elif qlen == 1 and persistent:
                cfg_q, sub_q = 1, 32
            else:
                refuse("fp8 gqa 32 runs qlen 1/2 persistent, qlen >= 3 persistent on gfx950")
    elif gqa == 64:
        if bf16:
            if not persistent:
                cfg_q, sub_q = (1 if qlen == 1 else 0), 64
        elif fp8:
            if persistent:
                cfg_q = 1 if qlen == 1 else 4
            else:
                refuse("fp8 gqa 64 runs persistent only")
    elif gqa == 8:
        if bf16 and not persistent:
            if qlen == 1:
                sub_q = gqa
            elif qlen == 2:
                sub_q, s_mqa = gqa * qlen, gqa
        elif fp8 and not persistent and qlen == 1:
            cfg_q, sub_q = 1, 8

    if arch == "gfx950" and persistent:
        if bf16 and (gqa * qlen >= 128 or gqa > 64) and gqa != 48:
            cfg_q, cfg_g, s_mqa = 4, 32, gqa
        elif bf16 and (gqa * qlen >= 64 or gqa >= 16):
            cfg_q, cfg_g, s_mqa = 1, 64, gqa
        elif fp8 and ((gqa == 32 and qlen >= 4) or (gqa == 64 and qlen >= 2) or gqa == 128):
            cfg_q, cfg_g, s_mqa = 4, 32, gqa
        elif fp8 and ((gqa == 16 and qlen in (3, 4)) or (gqa == 32 and qlen in (2, 3))
                      or (gqa == 64 and qlen == 1)):
            cfg_q, cfg_g, s_mqa = 4, 16, gqa
    key = dict(qType=q_type, kvType=kv_type, Gqa=cfg_g, ps=ps, qSeqLen=cfg_q, prefill=0,
               causal=cfg_causal, lse=int(bool(lse) and persistent), cprr=int(bool(cprr)))
    return key, sub_q, s_mqa


def select_kernel(table: KernelTable, **call) -> KernelChoice:
    """The first row of ``table`` matching :func:`kernel_key` (AITER's
    ``get_heuristic_kernel_mla``), with its ``.co`` checked to exist."""
    key, sub_q, s_mqa = kernel_key(**call)
    return find_kernel(table, key, sub_q=sub_q, s_mqa=s_mqa)


def find_kernel(table: KernelTable, key: dict, *, sub_q: int = 0, s_mqa: int = 0,
                layout=KERNEL_ARGS_LAYOUT, size: int = KERNEL_ARGS_SIZE,
                what: str = "asm MLA decode") -> KernelChoice:
    """AITER's ``get_heuristic_kernel_mla`` lookup: the first row of ``table`` whose columns
    equal ``key`` (absent columns read 0), with its ``.co`` checked to exist and to fit
    ``layout``."""
    for r in table.rows:
        if all(str(r.get(k) or 0) == str(v) for k, v in key.items()):
            co = os.path.join(table.directory, r["co_name"])
            if not os.path.isfile(co):
                raise AiterInstallError(
                    f"AITER's kernel table {table.path} names {r['co_name']} for {key}, but "
                    f"{co} does not exist: the AITER install is incomplete")
            check_code_object(co, r["knl_name"], layout, size)
            return KernelChoice(r["knl_name"], co, sub_q, s_mqa, tuple(sorted(key.items())))
    raise NotImplementedError(
        f"AITER's kernel table {table.path} has no {what} kernel for {key} (AITER "
        "itself fails with 'cannot get heuristic kernel' here)")


# --- the installed kernel set, for routing ---------------------------------------------------

_KEY_COLUMNS = ("qType", "kvType", "Gqa", "ps", "qSeqLen", "prefill", "causal", "lse", "cprr")


def _served(keys: frozenset, arch: str, q: str, kv: str, heads: int, qlen: int,
            persistent: bool, lse: bool) -> bool:
    """Whether a decode call finds a kernel among ``keys`` (AITER's lookup after its key
    rewrite, :func:`kernel_key`; causal, no ``cprr``), read conservatively in two places:
    a rewrite that drops ``ps`` (gfx942 bf16 128 heads, which AITER's persistent path folds to
    16 first) is no persistent kernel, and a kernel built for ``qSeqLen`` query tokens serves
    longer queries only when the rewrite hands it the head count in ``s_MQA`` (the generic
    kernels): the split-KV bf16 16-head qseqlen8 kernel is not taken to serve qlen > 8."""
    try:
        key, _, s_mqa = kernel_key(arch=arch, q_type=q, kv_type=kv, gqa=heads, qlen=qlen,
                                   persistent=persistent, lse=lse)
    except NotImplementedError:
        return False
    if key["ps"] != int(persistent):
        return False
    if key["qSeqLen"] and qlen > key["qSeqLen"] and s_mqa == heads * qlen:
        return False
    return tuple(str(key[c]) for c in _KEY_COLUMNS) in keys


def kernel_facts(table: KernelTable, arch: str) -> dict[tuple, bool]:
    """``table``'s decode kernels as :func:`capabilities.asm_kernel_facts` states them:
    ``{(q, kv, kernel heads, qlen, persistent): lse}`` over the same domain. Non-persistent
    kernels always return an LSE (the Triton stage 2 computes it); a persistent one does when
    the table has its ``lse=1`` variant."""
    keys = frozenset(tuple(str(r.get(c) or 0) for c in _KEY_COLUMNS) for r in table.rows)
    facts = {}
    for (q, kv), ps, h, qlen in itertools.product(
            caps.KERNEL_SET_DTYPES, (True, False), caps.KERNEL_SET_HEADS,
            range(1, caps.KERNEL_SET_MAX_QLEN + 1)):
        if _served(keys, arch, q, kv, h, qlen, ps, False):
            facts[(q, kv, h, qlen, ps)] = _served(keys, arch, q, kv, h, qlen, ps, True)
    return facts


def kernel_set_from_table(table: KernelTable, arch: str) -> caps.AsmKernelSet:
    """The :class:`capabilities.AsmKernelSet` of ``arch`` that ``table`` (its ``mla_asm.csv``)
    provides, in the form of :data:`capabilities.ASM_KERNELS`."""
    return caps.AsmKernelSet(caps.arch_info(arch).name,
                             caps.rows_from_facts(kernel_facts(table, arch)),
                             f"the installed AITER's {table.path}", installed=True)


@functools.cache
def _derived_kernel_set(path: str, arch: str) -> caps.AsmKernelSet:
    kernels = kernel_set_from_table(_read_table(path), arch)
    log.info("jax_mla: AITER's asm MLA decode on %s is routed by the installed kernel table %s",
             arch, path)
    return kernels


_table_warned: set[str] = set()


def installed_kernel_set(arch: str, base: str | None = None) -> caps.AsmKernelSet:
    """The asm decode kernel set routing uses for ``arch``, derived once per installation.

    From ``<base>/<arch>/mla/mla_asm.csv`` (``base`` default :func:`asm_dir`). Where no AITER
    ``hsa`` directory is found (e.g. planning ahead of time on a CPU host), the static table
    (:data:`capabilities.ASM_KERNELS`), and the set's ``source`` says so; where one is found
    but its table for ``arch`` is missing or of another form, the static table too, with one
    warning per table.
    """
    base = base or asm_dir()
    if base is None:
        return caps.static_kernel_set(arch, "no installed AITER hsa directory was found "
                                            "(AITER_ASM_DIR, aiter_meta/hsa, aiter's hsa/)")
    name = caps.arch_info(arch).name
    path = os.path.join(base, name, "mla", "mla_asm.csv")
    try:
        return _derived_kernel_set(path, name)
    except AiterInstallError as e:
        if path not in _table_warned:
            _table_warned.add(path)
            msg = (f"jax_mla: routing AITER's asm MLA decode on {name} by the static table of "
                   f"ROCm/aiter {AITER_COMMIT[:8]}, not the installed one: {e}")
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return caps.static_kernel_set(name, f"the installed table could not be read ({e})")


# --- the handler library ----------------------------------------------------------------------

def _library():
    from jax_mla.backends.triton import ffi_launch

    return ffi_launch._library()


def library_error(symbols=("JaxMlaAiterAsmExecuteRocm", "JaxMlaAiterAsmInitializeRocm",
                           "JaxMlaAiterAsmPackCpu", "JaxMlaAiterAsmLayout")) -> str | None:
    """Why the handler library cannot serve AITER's asm kernels, lacking one of ``symbols``
    (default the asm decode's handlers; None: it can)."""
    try:
        lib = _library()
    except (RuntimeError, OSError) as e:
        return str(e)
    for sym in symbols:
        if not hasattr(lib, sym):
            return (f"jax_mla's FFI library lacks {sym} (built without this ffi/aiter_asm.cc): "
                    "reinstall with `pip install -e .`")
    return None


def library_layout(symbol: str = "JaxMlaAiterAsmLayout") -> dict[str, int]:
    """An argument block's layout as the compiled library has it (``symbol``: the library's
    describing function; default the decode's): ``{field: offset, "size"}``."""
    buf = ctypes.create_string_buffer(4096)
    getattr(_library(), symbol)(buf, len(buf))
    return {k: int(v) for k, v in (item.split(":") for item in buf.value.decode().split(";"))}


def check_library_layout(symbol: str = "JaxMlaAiterAsmLayout", layout=KERNEL_ARGS_LAYOUT,
                         size: int = KERNEL_ARGS_SIZE, here: str = "native.py") -> None:
    """Raise if the library's argument block (``symbol``) differs from ``layout`` (default the
    decode's, :data:`KERNEL_ARGS_LAYOUT`), as written in ``here``."""
    got = library_layout(symbol)
    want = {name: off for name, off, _ in layout} | {"size": size}
    if got != want:
        diff = {k: (got.get(k), want.get(k)) for k in set(got) | set(want)
                if got.get(k) != want.get(k)}
        raise AiterInstallError(f"jax_mla's FFI library lays out AITER's kernel arguments "
                                f"differently from {here}: {diff} (library, {here})")


_REGISTER_LOCK = threading.Lock()
_registered: set[tuple[str, str]] = set()


def register_handlers(target: str, pack_target: str, symbols: str,
                      platforms=("ROCM", "cpu")) -> None:
    """Register the library's ``<symbols>InitializeRocm`` / ``<symbols>ExecuteRocm`` pair as
    ``target`` on ROCm and ``<symbols>PackCpu`` as ``pack_target`` on CPU (idempotent; no GPU
    needed)."""
    from jax_mla.backends.triton import ffi_launch

    with _REGISTER_LOCK:
        for platform in platforms:
            if (target, platform) in _registered:
                continue
            lib = _library()
            if platform == "cpu":
                jax.ffi.register_ffi_target(pack_target,
                                            jax.ffi.pycapsule(getattr(lib, symbols + "PackCpu")),
                                            platform="cpu")
            else:
                jax.ffi.register_ffi_target(
                    target,
                    ffi_launch.handler_stages(
                        lambda stage, lib=lib: jax.ffi.pycapsule(
                            getattr(lib, f"{symbols}{stage}Rocm"))),
                    platform=platform, traits=ffi_launch.command_buffer_traits())
            _registered.add((target, platform))


def preload(co_path: str, kernel_name: str) -> None:
    """Load AITER's kernel now, while its launch is traced, on every local ROCm device (as the
    Triton launcher's ``ffi_launch.preload``): the program's first execution, which XLA may
    record into a command buffer by stream capture, then finds it loaded. A device it does not
    load on is left to the launch's own error; a process without ROCm devices loads nothing
    (nor one with ``JAX_MLA_FFI_PRELOAD=0``)."""
    from jax_mla.backends.triton import ffi_launch

    def load(ordinal):
        err = ctypes.create_string_buffer(512)
        _library().JaxMlaAiterLoadKernel(ctypes.c_int(ordinal), co_path.encode(),
                                         kernel_name.encode(), err, ctypes.c_int(len(err)))

    ffi_launch.preload_on_devices("rocm", (co_path, kernel_name), load)


def register(platforms=("ROCM", "cpu")) -> None:
    """Register the asm decode's handlers with XLA (idempotent; no GPU needed)."""
    register_handlers(TARGET_NAME, PACK_TARGET_NAME, "JaxMlaAiterAsm", platforms)


def unavailable_reason(arch: str) -> str | None:
    """Why the native route cannot serve ``arch`` in this process (None: it can)."""
    err = library_error()
    if err is not None:
        return err
    try:
        check_library_layout()
        kernel_table(arch)
    except AiterInstallError as e:
        return str(e)
    return None


_warned: set[str] = set()


def warn_fallback(reason: str, what: str = "asm MLA decode") -> None:
    """Say once per process (per kernel family ``what``) that AITER's ``what`` runs through the
    Python bridge, and why. Also used by the segmented verify (``triton_kernels.py``)."""
    if what in _warned:
        return
    _warned.add(what)
    msg = (f"jax_mla: AITER's {what} runs through the Python bridge (a host round trip "
           f"per call, no command buffers) because the native launcher is unavailable: {reason}")
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


# --- the calls --------------------------------------------------------------------------------

def _scalar(x):
    return jnp.asarray(1.0 if x is None else x, jnp.float32).reshape((1,))


def _empty(dtype=jnp.int32):
    return jnp.zeros((0,), dtype)


def keep_persistent(arch: str, q_type: str, kv_type: str, heads: int, qlen: int,
                    batch: int) -> bool:
    """AITER's ``_use_persistent_mla_decode``: gfx950 bf16 16-head single-token decode drops to
    split-KV from ``AITER_MLA_DECODE_PERSISTENT_MAX_BATCH`` (default 32; <= 0 disables)."""
    if not (arch == "gfx950" and q_type == "bf16" and kv_type == "bf16" and heads == 16
            and qlen == 1):
        return True
    try:
        max_batch = int(os.environ.get("AITER_MLA_DECODE_PERSISTENT_MAX_BATCH", 32))
    except ValueError:
        max_batch = 32
    return max_batch <= 0 or batch < max_batch


_BLOCK_N_FP8 = {8: 64, 16: 128, 24: 128, 32: 128, 48: 64, 64: 64, 128: 32, 256: 32, 384: 32,
                512: 32}


def num_kv_splits(batch: int, total_kv: int, heads: int, qlen: int, q_type: str,
                  num_cu: int) -> int:
    """AITER's ``get_meta_param`` split count for the split-KV decode (static shapes only)."""
    batch = max(int(batch), 1)
    avg_kv = total_kv / batch
    best = max(((batch * i / (-(-batch * i // num_cu) * num_cu) * avg_kv / (avg_kv + 84.1 * i),
                 i) for i in range(1, 17)), key=lambda x: x[0])
    n = best[1]
    if q_type == "fp8":
        block_n = _BLOCK_N_FP8.get(int(heads * qlen))
        if block_n is None:
            raise NotImplementedError(f"AITER's fp8 split-KV decode has no block size for "
                                      f"{heads} heads x qlen {qlen}")
        n = min(n, (total_kv + batch * block_n - 1) // (batch * block_n))
        if n > 1:
            n = min(n, int(abs(total_kv / batch - qlen) // block_n) + 1)
    return max(int(n), 1)


def _merge_granularity(heads: int, qlen: int, q_type: str, kv_type: str) -> int:
    """``mgc`` of AITER's split merge: KV tokens per split that make a split count as used."""
    mgc = 64 if heads in (8, 16) and (qlen == 1 or (heads == 8 and qlen == 2)) else 16
    if (heads == 128 and q_type == "fp8" and kv_type == "fp8") or (
            heads == 64 and q_type == "bf16" and kv_type == "bf16" and qlen == 1):
        mgc = 32
    return mgc


def stage1(q, kv, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, *, choice: KernelChoice,
           scale: float, max_seqlen_q: int, page_size: int, persistent: bool, split_o, split_lse,
           out=None, final_lse=None, split_indptr=None, work_indptr=None, work_info=None,
           q_scale=None, kv_scale=None, g_kv_indptr=None, cp_world_size: int = 1,
           cp_rank: int = 0, pack: bool = False):
    """One ``jax_mla_aiter_asm_mla`` custom call (``pack``: its CPU twin).

    ``split_o``, ``split_lse``, ``out``, ``final_lse``: ``jax.ShapeDtypeStruct`` of the results
    (absent ones are empty). Returns ``(split_o, split_lse, out, final_lse, work_meta)`` and,
    with ``pack``, the packed argument block (``uint8[PACK_BYTES]``) last.
    """
    register(("cpu",) if pack else ("ROCM",))
    i32 = jnp.int32
    shapes = [split_o, split_lse,
              out if out is not None else jax.ShapeDtypeStruct((0,), jnp.bfloat16),
              final_lse if final_lse is not None else jax.ShapeDtypeStruct((0,), jnp.float32),
              # two uint64 device pointers, as four uint32 (no x64 needed)
              jax.ShapeDtypeStruct((4,) if persistent else (0,), jnp.uint32)]
    if pack:
        shapes.append(jax.ShapeDtypeStruct((PACK_BYTES,), jnp.uint8))
    opt = [split_indptr, work_indptr, work_info]
    args = [q, kv, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens,
            *[_empty(i32) if a is None else a.astype(i32) for a in opt],
            _empty(jnp.float32) if q_scale is None else _scalar(q_scale),
            _empty(jnp.float32) if kv_scale is None else _scalar(kv_scale),
            _empty(i32) if g_kv_indptr is None else g_kv_indptr.astype(i32)]
    if not pack:
        preload(choice.co_path, choice.kernel_name)
    call = jax.ffi.ffi_call(PACK_TARGET_NAME if pack else TARGET_NAME, tuple(shapes))
    return tuple(call(
        *args, co_path=choice.co_path, kernel_name=choice.kernel_name,
        softmax_scale=np.float32(scale), max_seqlen_q=np.int32(max_seqlen_q),
        page_size=np.int32(page_size), s_mqa=np.int32(choice.s_mqa), sub_q=np.int32(choice.sub_q),
        persistent=np.int32(bool(persistent)), cp_world_size=np.int32(cp_world_size),
        cp_rank=np.int32(cp_rank)))


def asm_decode(q, kv_cache, md, route, schedule, *, scale: float, q_scale=None, kv_scale=None,
               base: str | None = None):
    """``bridge.asm_decode``'s contract through the native launcher.

    Args:
      q: ``[T, n_dec, D]`` bf16 or fp8 (unpadded; padded here with vLLM's maps).
      kv_cache: ``[num_pages, page_size, D]`` (viewed as page size 1, like the bridge).
      md, route, schedule: the decode metadata, its plan's route and its arrays.
      base: AITER's ``hsa`` directory (default :func:`asm_dir`).
    Returns ``(out [T, n_dec, L], lse [T, n_dec] float32 | None)``.
    """
    n, hp, qlen = route.num_heads, route.kernel_heads, route.qlen
    t, _, d = q.shape
    lr = d - 64
    qp = _heads.pad_heads(q, n, hp)
    kv4 = kv_cache.reshape(-1, 1, 1, d)
    bs = md.qo_indptr.shape[0] - 1
    out_dt = out_dtype(q.dtype)
    table = kernel_table(route.arch, base)
    persistent = route.persistent and schedule.plan is not None and keep_persistent(
        route.arch, route.q_dtype, route.kv_dtype, hp, qlen, bs)
    # Scales default to 1.0 and always travel, as the bridge passes them (the handler hands
    # them to the kernel only for fp8, as AITER does).
    common = dict(scale=scale, max_seqlen_q=qlen, page_size=1,
                  q_scale=1.0 if q_scale is None else q_scale,
                  kv_scale=1.0 if kv_scale is None else kv_scale)
    idx = (md.qo_indptr, md.paged_kv_indptr, md.paged_kv_indices, md.paged_kv_last_page_len)
    f32 = jnp.float32
    if persistent:
        plan = schedule.plan
        ratio, hk = plan.fold_ratio, plan.kernel_heads
        qf = fold_rows(qp, qlen, ratio)
        choice = select_kernel(table, arch=route.arch, q_type=route.q_dtype,
                               kv_type=route.kv_dtype, gqa=hk, qlen=qlen, persistent=True,
                               lse=route.return_lse)
        rows, tf = plan.scratch_rows, qf.shape[0]
        s_o, s_lse, out, lse, _ = stage1(
            qf, kv4, *idx, choice=choice, persistent=True,
            split_o=jax.ShapeDtypeStruct((rows, 1, hk, lr), f32),
            split_lse=jax.ShapeDtypeStruct((rows, 1, hk, 1), f32),
            out=jax.ShapeDtypeStruct((tf, hk, lr), out_dt),
            final_lse=jax.ShapeDtypeStruct((tf, hk), f32) if route.return_lse else None,
            work_indptr=plan.work_indptr, work_info=plan.work_info_set, **common)
        if not route.return_lse:
            lse = jnp.full((tf, hk), -jnp.inf, f32)
        final, final_lse = reduce_plan_reference(out.astype(f32), lse, s_o[:, 0],
                                                 s_lse[:, 0, :, 0], plan)
        out = unfold_rows(final, qlen, ratio).astype(out_dt)
        lse = unfold_rows(final_lse, qlen, ratio)
    else:
        nsplit = num_kv_splits(bs, md.paged_kv_indices.shape[0], hp, qlen, route.q_dtype,
                               route.num_cu or caps.arch_info(route.arch).num_cu)
        choice = select_kernel(table, arch=route.arch, q_type=route.q_dtype,
                               kv_type=route.kv_dtype, gqa=hp, qlen=qlen, persistent=False,
                               lse=False)
        # One split: the kernel writes final 16-bit rows into split_o (aiter's "final out"),
        # except the 8/16-head single-token kernels, whose split_o stays float32 and merged.
        direct = nsplit == 1 and not (hp in (8, 16) and qlen == 1)
        s_o, s_lse, _, flse, _ = stage1(
            qp, kv4, *idx, choice=choice, persistent=False,
            split_o=jax.ShapeDtypeStruct((t, nsplit, hp, lr), out_dt if direct else f32),
            split_lse=jax.ShapeDtypeStruct((t, nsplit, hp, 1), f32),
            final_lse=jax.ShapeDtypeStruct((t, hp), f32) if direct and route.return_lse
            else None,
            split_indptr=jnp.arange(0, (bs + 1) * nsplit, nsplit, dtype=jnp.int32), **common)
        if direct:
            out = s_o[:, 0].astype(out_dt)
            lse = flse if route.return_lse else s_lse[:, 0, :, 0]
        else:
            out, lse = _merge_splits(s_o, s_lse[..., 0], md, bs, nsplit,
                                     _merge_granularity(hp, qlen, route.q_dtype, route.kv_dtype))
            out = out.astype(out_dt)
    out = _heads.unpad_heads(out, n, hp)
    lse = _heads.unpad_heads(lse, n, hp) if route.return_lse else None
    return out, lse


def _merge_splits(split_o, split_lse, md, batch: int, nsplit: int, mgc: int):
    """AITER's split merge (``_fwd_kernel_stage2_asm``) in jnp: row ``r`` of request ``b``
    merges its first ``min(nsplit, ceil(kv_len_b / mgc))`` splits; a row with none gives 0 and
    ``-inf``. Returns ``(out [T, H, L] float32, lse [T, H])``."""
    t = split_o.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(md.qo_indptr, rows, side="right") - 1, 0, max(batch - 1, 0))
    kv_len = md.paged_kv_indptr[b + 1] - md.paged_kv_indptr[b]
    valid = jnp.minimum(nsplit, (kv_len + mgc - 1) // mgc)  # [T]
    on = jnp.arange(nsplit, dtype=jnp.int32)[None, :] < valid[:, None]  # [T, S]
    lse = jnp.where(on[..., None], split_lse, -jnp.inf)  # [T, S, H]
    m = jnp.max(lse, axis=1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    w = jnp.exp(lse - m)  # 0 for unused splits
    z = jnp.sum(w, axis=1)  # [T, H]
    acc = jnp.einsum("tsh,tshl->thl", w, jnp.where(on[..., None, None], split_o, 0.0))
    empty = z == 0
    out = jnp.where(empty[..., None], 0.0, acc / jnp.where(empty, 1.0, z)[..., None])
    lse = jnp.where(empty, -jnp.inf, m[:, 0] + jnp.log(jnp.where(empty, 1.0, z)))
    return out, lse
