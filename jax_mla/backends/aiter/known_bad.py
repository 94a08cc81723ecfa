"""AITER kernels known to fail, when they fail, and the route taken instead: one table, as data.

Each row of :data:`KNOWN_BAD` names an asm decode kernel AITER ships, the shape that selects it
(arch, dtypes, the head count it is called with, qlen, persistent or not, its LSE variant or
not, the page size of the KV view it reads), the AITER versions affected, the upstream issue,
and a replacement route the planner already expresses. The table is consulted once, when a plan
is built (:func:`route_around`, called by ``plan.make_plan`` after vLLM's routing): a route that
would launch a listed kernel takes the replacement instead and says so
(``AiterRoute.avoided``, ``AiterRoute.notes``). The override (``JAX_MLA_AITER_ALLOW_KNOWN_BAD``,
or ``allow_known_bad=`` when planning; :func:`allowed_kernels`) keeps the original route, for an
AITER whose kernel is fixed; the route then says that it runs a known-bad kernel
(``AiterRoute.known_bad_allowed``).

Replacements (:data:`REPLACEMENTS`): ``"fold16"`` runs the head count as ``F = heads / 16``
pseudo-batches of 16 heads, AITER's own persistent fold (docs/design.md §7.7; the planner's
``fold_ratio`` with ``force_fold``), so AITER's 16-head kernel for the shape runs instead.
A page-size view is no replacement here: every asm route hands AITER the per-token view
(:data:`KV_VIEW_PAGE_SIZE`), whatever the cache's page size.

Nothing here has run on AMD hardware: the rows are read from the upstream reports.
"""

from __future__ import annotations

import dataclasses
import re

from jax_mla import env
from jax_mla.backends.aiter import capabilities as caps

# The page size of the KV view every asm route reads: the per-token (flat) view, the cache
# passed as [-1, 1, 1, 576] (schedule.VIEWS; bridge.asm_decode, native.asm_decode).
KV_VIEW_PAGE_SIZE = 1

ALLOW_ENV = "JAX_MLA_AITER_ALLOW_KNOWN_BAD"

# The replacement routes a row may name: "fold16", the heads as 16-head pseudo-batches (AITER's
# persistent fold, taken for a count it serves natively; the route's force_fold).
REPLACEMENTS = ("fold16",)


@dataclasses.dataclass(frozen=True, repr=False)
class KnownBadKernel:
    """One AITER asm decode kernel known to fail, and the route taken instead.

    Attributes:
      kernel: the kernel's name as AITER's ``mla_asm.csv`` lists it (its ``.co`` without the
        suffix, ``knl_name`` demangled).
      arch, q, kv, heads, qlen, persistent, lse: the shape that selects it under AITER's key
        rewrite (``native.kernel_key``): arch, dtype names, the head count it is called with
        (padded, unfolded), query length, persistent mode, and whether the route asks for the
        LSE (its ``_lse`` variant is another kernel).
      page_size: the page size of the KV view at which it fails.
      issue: the upstream report, ``owner/repo#number``.
      symptom: what goes wrong, in a few words.
      affected: the AITER versions affected, in words.
      fixed_in: the first AITER version (``amd-aiter``, PEP 440) known to be fixed; ``None``:
        none known, so every version that ships the kernel is affected.
      replacement: the route taken instead, one of :data:`REPLACEMENTS`.
      replacement_kernel: the kernel that replacement runs (for messages and the doctor).
      why_safe: why the replacement avoids the fault.
    """

    kernel: str
    arch: str
    q: str
    kv: str
    heads: int
    qlen: int
    persistent: bool
    lse: bool
    page_size: int
    issue: str
    symptom: str
    affected: str
    fixed_in: str | None
    replacement: str
    replacement_kernel: str
    why_safe: str

    def __repr__(self) -> str:
        return f"KnownBadKernel({self.kernel}, {self.issue}, instead: {self.replacement})"

    def shape(self) -> str:
        """The condition in words: ``gfx942, q fp8 / kv fp8, 64 heads, qlen 1, ...``."""
        return (f"{self.arch}, q {self.q} / kv {self.kv}, {self.heads} heads, qlen {self.qlen}, "
                f"{'persistent' if self.persistent else 'split-KV'}, "
                f"{'with' if self.lse else 'no'} LSE, page size {self.page_size}")

    def instead(self) -> str:
        """The replacement in words (``fold16``, the one there is)."""
        return (f"{self.heads // caps.MIN_HEADS} pseudo-batches of 16 heads on "
                f"{self.replacement_kernel}")

    def avoided_note(self) -> str:
        return (f"{self.kernel} avoided ({self.issue}: {self.symptom}); runs as "
                f"{self.instead()} instead ({ALLOW_ENV}={self.kernel} keeps it)")

    def allowed_note(self) -> str:
        return (f"{self.kernel} runs although known bad ({self.issue}: {self.symptom}), "
                f"allowed by the override ({ALLOW_ENV} or allow_known_bad=)")


KNOWN_BAD: tuple[KnownBadKernel, ...] = (
    KnownBadKernel(
        kernel="mla_a8w8_qh64_qseqlen1_gqaratio64_v3_ps",
        arch="gfx942", q="fp8", kv="fp8", heads=64, qlen=1, persistent=True, lse=False,
        page_size=1,
        issue="ROCm/aiter#4363",
        symptom="GPU memory access fault at page size 1",
        affected=("every AITER that ships it: added by ROCm/aiter#3188 (checked there at page "
                  "size 64 only; amd-aiter 0.1.18 has it), present at the pinned e4048607; no "
                  "fixed release known (fixes proposed in ROCm/aiter#4365 and #4957, open when "
                  "this row was written)"),
        fixed_in=None,
        replacement="fold16",
        replacement_kernel="mla_a8w8_qh16_qseqlen1_gqaratio16_ps",
        why_safe=("the 64 heads become 4 pseudo-batches of 16 on the 16-head fp8 persistent "
                  "kernel, the one AITER ran for 64 heads before ROCm/aiter#3188 made them "
                  "native (a fold that did not fault, ROCm/aiter#4957 reports) and the one that "
                  "proposed fix returns to; the faulting kernel is never launched"),
    ),
)

KERNELS = tuple(row.kernel for row in KNOWN_BAD)


# ---------------------------------------------------------------------------------------------
# Versions


_VERSION = re.compile(r"v?(\d+(?:\.\d+)*)(.*)")
_PRE = re.compile(r"[.\-_]?(a|b|c|rc|alpha|beta|pre|preview|dev)\d*", re.IGNORECASE)


def _release(version: str) -> tuple[tuple[int, ...], bool] | None:
    """``(release numbers, is a pre-release or development build)``, None when unparsable."""
    m = _VERSION.fullmatch(version.strip())
    if m is None:
        return None
    return tuple(int(x) for x in m.group(1).split(".")), bool(_PRE.match(m.group(2)))


def affects_version(row: KnownBadKernel, version: str | None) -> bool:
    """Whether AITER ``version`` is affected by ``row``: always where no fix is known or the
    version is unknown or unparsable; else when it comes before ``row.fixed_in`` (a
    development or pre-release build of that release counts as before it)."""
    if row.fixed_in is None or version is None:
        return True
    have, fixed = _release(version), _release(row.fixed_in)
    if have is None or fixed is None:
        return True
    n = max(len(have[0]), len(fixed[0]))
    got, want = (have[0] + (0,) * (n - len(have[0])), fixed[0] + (0,) * (n - len(fixed[0])))
    return got < want or (got == want and have[1])


# ---------------------------------------------------------------------------------------------
# The override


def allowed_kernels(allow=None) -> frozenset[str]:
    """The known-bad kernels plans may launch anyway: ``allow`` if given, else
    ``JAX_MLA_AITER_ALLOW_KNOWN_BAD`` (read when a plan is built).

    ``True``/``"all"``/``"1"``: every row's kernel; ``False``/``"0"``/unset: none; otherwise
    kernel names (a comma-separated string or an iterable), each one of :data:`KERNELS`.
    """
    if allow is None:
        allow = env.read_str(ALLOW_ENV) or False
    if allow is True:
        return frozenset(KERNELS)
    if allow is False:
        return frozenset()
    names = [n.strip() for n in allow.split(",")] if isinstance(allow, str) else list(allow)
    names = [n for n in names if n]
    if names in (["all"], ["1"]):
        return frozenset(KERNELS)
    if names in ([], ["0"]):
        return frozenset()
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"{ALLOW_ENV} / allow_known_bad names {', '.join(unknown)}, not in the "
                         f"table of known-bad AITER kernels ({', '.join(KERNELS)}; or 'all')")
    return frozenset(names)


# ---------------------------------------------------------------------------------------------
# Consulting the table


def hits(row: KnownBadKernel, route: caps.AiterRoute, *,
         page_size: int = KV_VIEW_PAGE_SIZE) -> bool:
    """Whether ``route`` (read through the KV view of ``page_size``) launches ``row.kernel``:
    an asm route of the row's shape whose count AITER runs unfolded."""
    if route.kind != "asm" or route.force_fold:
        return False
    if (route.arch, route.q_dtype, route.kv_dtype, route.kernel_heads, route.qlen,
            route.persistent, route.return_lse, page_size) != (
            row.arch, row.q, row.kv, row.heads, row.qlen, row.persistent, row.lse,
            row.page_size):
        return False
    if route.persistent:
        return caps.fold_ratio(route.arch, route.kernel_heads, route.q_dtype, route.kv_dtype,
                               route.qlen) == 1
    return True


def route_around(route: caps.AiterRoute, *, version: str | None = None,
                 allow: frozenset[str] = frozenset()) -> caps.AiterRoute:
    """``route`` with each known-bad kernel it would launch replaced (``avoided``), except
    those in ``allow`` (kept, and listed in ``known_bad_allowed``). ``version``: the installed
    AITER's (``AiterBuild.version``); a version at or past a row's fix is not affected."""
    hit = [row for row in KNOWN_BAD if hits(row, route) and affects_version(row, version)]
    if not hit:
        return route
    kept = tuple(row for row in hit if row.kernel in allow)
    avoided = tuple(row for row in hit if row.kernel not in allow)
    unknown = [row.replacement for row in avoided if row.replacement not in REPLACEMENTS]
    if unknown:
        raise NotImplementedError(f"no replacement route named {unknown}")
    return dataclasses.replace(route, avoided=avoided, known_bad_allowed=kept,
                               force_fold=any(row.replacement == "fold16" for row in avoided))


def present_in(kernels: caps.AsmKernelSet) -> tuple[KnownBadKernel, ...]:
    """The rows whose kernel ``kernels`` (an arch's kernel set: installed, or the static table)
    has: the row's shape is served, read through AITER's key rewrite like every route."""
    return tuple(
        row for row in KNOWN_BAD
        if row.arch == kernels.arch and caps.asm_kernel_served(
            kernels.rows, row.q, row.kv, row.heads, row.qlen, persistent=row.persistent,
            lse=row.lse) is not False)
