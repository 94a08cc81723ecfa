"""The AITER backend's plan: the routing decision for one problem, with what it was made for.

The route (``capabilities.decide_route``) depends on the arch, the installed AITER build and
its asm kernel set, the device's CU count, the dtypes, head and query counts, DCP and the
small-head mode; then the table of known-bad AITER kernels (``known_bad.py``) replaces a route
that would launch one of them, unless the override allows it. All of them are settled here,
once, when the plan is built: detected from the device and the installed AITER when not given
(:func:`make_plan`), and carried as static data.
"""

from __future__ import annotations

import dataclasses

from jax_mla.backends.aiter import bridge, known_bad, native
from jax_mla.backends.aiter import capabilities as caps
from jax_mla.backends.base import DecodePlan
from jax_mla.problem import DecodeProblem


@dataclasses.dataclass(frozen=True)
class AiterPlan(DecodePlan):
    """The AITER backend's route for one problem.

    Attributes (besides :class:`~jax_mla.backends.DecodePlan`'s):
      route: the routing decision (:class:`~.capabilities.AiterRoute`).
      build: the AITER build it was decided for (detected, or given), with the asm kernel set
        (``build.asm_kernels``, also ``route.asm_kernels``) the route was checked against.
      capacity_batch: the batch the persistent plan's buffers are sized for.

    ``notes`` (the route's) says, one sentence each, which known-bad AITER kernel the route goes
    around and what runs instead, or which one it runs because the override allows it.
    """

    route: caps.AiterRoute = None
    build: caps.AiterBuild = None
    capacity_batch: int = 0

    @property
    def notes(self) -> tuple[str, ...]:
        return self.route.notes

    def mismatches(self, problem: DecodeProblem) -> list[str]:
        r = self.route
        out = []
        if self.problem.target.platform != problem.target.platform:
            out.append(f"target: planned {self.problem.target}, call {problem.target}")
        for what, got, want in (("num_heads (q.shape[1])", problem.num_heads, r.num_heads),
                                ("qlen", problem.qlen, r.qlen),
                                ("page_size", problem.page_size, self.problem.page_size)):
            if got != want:
                out.append(f"{what}: planned {want}, call {got}")
        for what, got, want in (("q", problem.q_dtype, r.q_dtype),
                                ("kv_cache", problem.kv_dtype, r.kv_dtype)):
            if caps.dtype_name(got) != want:
                out.append(f"{what} dtype: planned {want}, call {got} (pass q_dtype/kv_dtype to "
                           "build_aiter_decode_metadata)")
        if problem.return_lse and not r.return_lse:
            out.append("return_lse: the plan asks the kernel for no LSE (pass return_lse=True "
                       "to build_aiter_decode_metadata)")
        return out


def resolve_arch(arch, target) -> str:
    """``arch`` if given, else the target's, else the device's; a clear error off ROCm."""
    if arch is None and target.platform == "rocm":
        arch = target.arch
    if arch is None:
        arch = caps.detect_arch()
    if arch is None:
        raise ValueError("not on a ROCm gfx942/gfx950 device: pass arch='gfx942' or 'gfx950'")
    caps.arch_info(arch)
    return arch


def make_plan(name: str, problem: DecodeProblem, *, arch: str | None = None,
              num_cu: int | None = None, mtp_decode_qlen: int | None = None,
              dcp_world_size: int = 1, cp_interleave: int = 1, return_lse: bool | None = None,
              small_head_mode: str | None = None, build: caps.AiterBuild | None = None,
              capacity_batch: int | None = None, check_kernels: bool = True,
              allow_known_bad=None) -> AiterPlan:
    """Decide the route for ``problem`` (see ``build_aiter_decode_metadata`` for the options).

    Defaults, each settled now: ``arch`` and ``num_cu`` from the target device (off a ROCm
    device: ``detect_arch()`` and the arch's flagship CU count); ``build`` probed from the
    installed ``aiter`` (AITER HEAD's capabilities when none is importable); the build's asm
    kernel set, unless it carries one (``build.asm_kernels``), derived from the installed
    AITER's ``hsa/<arch>/mla/mla_asm.csv`` once per installation
    (``native.installed_kernel_set``; the static table where none is found, and the set's
    ``source`` says so); ``small_head_mode`` from ``JAX_MLA_AITER_SMALL_HEAD_MODE``;
    ``return_lse`` from the problem, or DCP; ``allow_known_bad`` (known-bad kernels to launch
    anyway: ``True``, kernel names, or ``False``) from ``JAX_MLA_AITER_ALLOW_KNOWN_BAD``.

    vLLM's route is then checked against the table of known-bad kernels
    (``known_bad.route_around``): one it would launch is replaced (``route.avoided``), unless
    allowed (``route.known_bad_allowed``); ``plan.notes`` says which. With ``check_kernels`` a
    route that kernel set has no kernel for raises ``NotImplementedError`` naming the kernel
    (``capabilities.check_route_kernels``).
    """
    target = problem.target
    arch = resolve_arch(arch, target)
    if num_cu is None and target.platform == "rocm" and target.arch:
        num_cu = target.num_cores
    if build is None:
        build = bridge.installed_build() if bridge.aiter_importable() else caps.DEFAULT_BUILD
    if build.asm_kernels is None:
        build = dataclasses.replace(build, asm_kernels=native.installed_kernel_set(arch))
    if return_lse is None and problem.return_lse:
        return_lse = True
    route = caps.decide_route(arch=arch, num_heads=problem.num_heads, qlen=problem.qlen,
                              q_dtype=problem.q_dtype, kv_dtype=problem.kv_dtype,
                              dcp_world_size=dcp_world_size, cp_interleave=cp_interleave,
                              mtp_decode_qlen=mtp_decode_qlen, return_lse=return_lse,
                              num_cu=num_cu, build=build,
                              mode=caps.small_head_mode(small_head_mode))
    route = known_bad.route_around(route, version=build.version,
                                   allow=known_bad.allowed_kernels(allow_known_bad))
    if check_kernels:
        caps.check_route_kernels(route)
    return AiterPlan(backend=name, problem=problem, padded_heads=problem.num_heads, route=route,
                     build=build, capacity_batch=capacity_batch or problem.num_seqs)
