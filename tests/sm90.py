"""Compile a @triton.jit kernel for an H100/H200 (sm_90a) on a machine without a GPU, and read what the
GPU run would get: registers, spill bytes, shared memory, which MMA (v2 mma.sync or v3 wgmma), synchronous loads in
loops, and the instructions of the largest loop (a GEMM's K step).

`triton.compile` needs no driver for this; ptxas and cuobjdump ship in the triton wheel. The args
are given as a launch would give them, so the compile sees the same specialisation: a pointer is
its element type ("*bf16"; assumed 16-byte aligned, as torch allocations are; a tuple of tensors a
tuple of those), an int its value
(divisible by 16 -> specialised as such unless the kernel's `do_not_specialize` names it), a float
its value. Constexprs are passed separately.

A kernel with a `PDL` constexpr (programmatic dependent launch, kernels/pdl.py) compiles with it on, as
it launches on Hopper, and its PTX must wait (`griddepcontrol.wait`) before its first global load or
store: reading before the wait races with the previous kernel. Only the kernels in PREFETCH_BEFORE_WAIT
load first (where its predicate of the constexprs holds): their weights, which no kernel writes, or what a
kernel two launches back wrote (the down GEMV's ids). L2 prefetches (`pdl.prefetch`) are not accesses.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


_ALWAYS = lambda constexprs: True  # noqa: E731
PREFETCH_BEFORE_WAIT = {"_linear_kernel": _ALWAYS, "_linear_dot_kernel": _ALWAYS,
                        "_down_gemv_kernel": lambda c: c.get("EARLY")}
_GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global|st\.global|atom\.global|red\.global|cp\.async|"
                            r"cp\.reduce|ld\.volatile\.global)", re.M)


def accesses_before_wait(ptx: str) -> list[str]:
    """The global-memory instructions of `ptx` before its first griddepcontrol.wait (all of them if none)."""
    wait = ptx.find("griddepcontrol.wait")
    head = ptx if wait < 0 else ptx[:wait]
    return [m.group(0).strip() for m in _GLOBAL_ACCESS.finditer(head)]


@dataclass(frozen=True)
class Compiled:
    regs: int  # registers per thread (255 is the ceiling)
    stack: int  # bytes of stack frame per thread: spills live there
    smem: int  # dynamic shared memory bytes per program
    mma: tuple[int, ...]  # MMA versions used (2: mma.sync, 3: wgmma)
    loop_loads: int = 0  # global loads inside loops that were not made async copies: a round trip each
    cubin: bytes = field(default=b"", repr=False, compare=False)

    @cached_property
    def loop_sass(self) -> int:
        """SASS instructions in the largest loop body: a GEMM's K step, what its warps issue. Read when asked:
        the SASS dump takes cuobjdump about 0.3 s a kernel, the rest of a compile check under 0.01 s once cached."""
        return largest_loop(_cuobjdump(self.cubin, "-sass"))

    def __str__(self) -> str:
        return (f"regs {self.regs}, stack {self.stack} B, smem {self.smem} B, mma v{self.mma}, "
                f"{self.loop_loads} synchronous loads in loops, largest loop {self.loop_sass} SASS instructions")


def loop_loads(ttgir: str) -> int:
    """How many `tt.load`s of `ttgir` sit inside an scf.for body (indentation marks the nesting)."""
    count, loops = 0, []  # the indentation of each open loop
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        while loops and indent <= loops[-1] and line.strip().startswith("}"):
            loops.pop()
        if loops and "= tt.load " in line:
            count += 1
        if "scf.for " in line and line.rstrip().endswith("{"):
            loops.append(indent)
    return count


def largest_loop(sass: str) -> int:
    """Instructions between the target and the source of the longest backward branch of `cuobjdump -sass`."""
    addrs = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = 0
    for addr, ins in addrs:
        t = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if t and int(t.group(1), 16) < addr:
            best = max(best, sum(int(t.group(1), 16) <= a <= addr for a, _ in addrs))
    return best


def compile_sm90(kernel: Any, args: dict[str, Any], constexprs: dict[str, Any], *, num_warps: int,
                 num_stages: int, enable_fp_fusion: bool = True) -> Compiled:
    """Compile `kernel` (a triton JITFunction) for sm_90a with `args` (every non-constexpr parameter)."""
    names = kernel.arg_names
    if "PDL" in names:  # the kernels that take part in programmatic dependent launch compile as launched
        constexprs = {"PDL": True, **constexprs}
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constexprs = {**{n: v for n, v in defaults.items() if n not in args}, **constexprs}  # as a launch leaves them
    missing = [n for n in names if n not in args and n not in constexprs]
    if missing:
        raise ValueError(f"compile_sm90: no value for {missing}")
    dns = {p.name for p in kernel.params if p.do_not_specialize}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, str):
            signature[name], attrs[(i,)] = v, [["tt.divisibility", 16]]
        elif isinstance(v, tuple) and all(isinstance(e, str) for e in v):  # a tuple of pointers
            signature[name] = v
            attrs.update({(i, k): [["tt.divisibility", 16]] for k in range(len(v))})
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"compile_sm90: {name}={v!r} is not a pointer type, int or float")
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and name not in dns:
                attrs[(i,)] = [["tt.divisibility", 16]]
    if getattr(kernel, "is_gluon", lambda: False)():  # a Gluon kernel (kernels/moe_fragments.py)
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    else:
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": enable_fp_fusion}
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    if constexprs.get("PDL"):
        assert "griddepcontrol.wait" in ck.asm["ptx"], f"{kernel.fn.__name__}: PDL on but no griddepcontrol.wait"
    if constexprs.get("PDL") and not PREFETCH_BEFORE_WAIT.get(kernel.fn.__name__, lambda c: False)(constexprs):
        early = accesses_before_wait(ck.asm["ptx"])
        assert not early, f"{kernel.fn.__name__} touches global memory before griddepcontrol.wait: {early[:3]}"
    usage = _cuobjdump(ck.asm["cubin"], "--dump-resource-usage")
    value = lambda key: int(re.search(rf"{key}:(\d+)", usage).group(1))  # noqa: E731
    mma = tuple(sorted({int(v) for v in re.findall(r"nvidia_mma<\{versionMajor = (\d)", ck.asm["ttgir"])}))
    return Compiled(value("REG"), value("STACK"), ck.metadata.shared, mma, loop_loads(ck.asm["ttgir"]),
                    ck.asm["cubin"])


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(CUOBJDUMP), flag, str(path)], capture_output=True, text=True, check=True).stdout
