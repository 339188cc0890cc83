"""Compile the sparse-attention kernels for sm_90 on any machine (no GPU needed) and write each one's PTX
instruction stream (debug info and labels stripped), so that a refactor can be checked to leave the generated
code unchanged before any GPU time is spent on it; also prints each kernel's registers and stack (spills)
from the compiled cubin.

    python benchmarks/kernel_ptx.py OUT_DIR                 # write OUT_DIR/<config>.ptx
    python benchmarks/kernel_ptx.py OUT_DIR --compare REF   # also report which differ from REF_DIR/<config>.ptx

The configs are the committed defaults (long and short rows) at H=16, D=128, block 128, bf16, plus a GQA 4:1
dK/dV. Pointers and strides are specialised as divisible by 16, as the launcher does for contiguous
``[T, H, 128]`` tensors; the local Triton may differ from the GPU machine's, so registers are indicative.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kernels.sparse_attention import triton_kernels as tk  # noqa: E402

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16", "DK": "*bf16",
            "DV": "*bf16", "LSE": "*fp32", "DELTA": "*fp32"}
DESCRIPTORS = ("KD", "VD", "QD", "DOD")  # forward / dQ: K and V tiles; dK/dV: Q and dO tiles
INDEX_ARRAYS = ("blk_start", "blk_end", "q2k_start", "q2k_cnt", "q_order", "k2q_ptr", "k2q_start", "k2q_end",
                "k_order")


def signature(fn, consts: dict, box: list | None = None) -> dict:
    """Triton signature of a kernel: tensors, int32 index arrays, fp32 scales, int32 sizes and strides, and
    the tensor descriptors (``box``: their block shape) unless they are constants (None: no TMA)."""
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in DESCRIPTORS:
            sig[name] = f"tensordesc<bf16{box}>"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
        elif name in INDEX_ARRAYS:
            sig[name] = "*i32"
        else:
            sig[name] = "fp32" if name in ("qk_scale", "sm_scale") else "i32"
    return sig


def divisible_by_16(sig: dict) -> dict:
    """Specialisation attributes: tensors, index arrays and the (token, head) strides are 16-divisible."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
            if ty.startswith("*") or re.fullmatch(r"s[a-z]{1,3}[th]", name)}


def resources(cubin: bytes) -> str:
    """``REG:n STACK:bytes`` of a cubin, by the cuobjdump that ships with Triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"REG:{m.group(1)} STACK:{m.group(2)}" if m else "REG:? STACK:?"


def jobs():
    """(name, kernel, constexprs, warps, stages, descriptor box or None) of each compiled config, each also
    once with pointer tiles (``_ptr``: what runs where TMA cannot)."""
    kernels = {"fwd": tk._fwd_kernel, "dq": tk._bwd_dq_kernel, "dkdv": tk._bwd_dkdv_kernel}
    for kind, fn in kernels.items():
        params = inspect.signature(fn.fn).parameters
        for suffix, rows, G in (("", 64, 1), ("_short", 8, 1)) + ((("_gqa4", 64, 4),) if kind == "dkdv" else ()):
            cfg = tk.get_config(kind, 128, 128, row_blocks=rows)
            consts = dict(G=G, BLOCK=128, BM=cfg["BM"], BN=cfg["BN"], D=128, PREC="tf32",
                          HEAD_OUTER=cfg["HEAD_OUTER"])
            for ptr in (False, True) if "TMA" in params else (False,):
                tma = bool(cfg.get("TMA")) and not ptr
                flags = {"TMA": tma, "WS": tma and cfg.get("WS", False)}
                extra = {k: v for k, v in flags.items() if k in params}
                if not tma:
                    extra.update({d: None for d in DESCRIPTORS if d in params})
                rows = cfg["BM"] if kind == "dkdv" else cfg["BN"]
                yield (kind + suffix + ("_ptr" if ptr else ""), fn, {**consts, **extra}, cfg["num_warps"],
                       tk._stages(cfg, tma), [rows, 128] if tma else None)


def instructions(ptx: str) -> str:
    """The PTX code without its DWARF sections, source locations, comments and debug labels (all of which
    move with source lines)."""
    code = ptx.split(".section", 1)[0]
    lines = (line.split("//")[0].rstrip() for line in code.splitlines())
    return "\n".join(line for line in lines if line and not line.lstrip().startswith((".loc", ".file"))
                     and not re.fullmatch(r"\$L__tmp\d+:", line)) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--compare", metavar="REF_DIR")
    args = ap.parse_args()
    if args.compare and not os.path.isdir(args.compare):
        ap.error(f"--compare {args.compare!r} is not a directory (write one first: kernel_ptx.py REF_DIR)")
    os.makedirs(args.out, exist_ok=True)
    differ = []
    for name, fn, consts, warps, stages, box in jobs():
        sig = signature(fn, consts, box)
        src = ASTSource(fn=fn, signature=sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()},
                        attrs=divisible_by_16(sig))
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        code = instructions(compiled.asm["ptx"])
        usage = resources(compiled.asm["cubin"])
        with open(os.path.join(args.out, name + ".ptx"), "w") as f:
            f.write(code)
        if args.compare:
            ref_path = os.path.join(args.compare, name + ".ptx")
            ref = open(ref_path).read() if os.path.exists(ref_path) else None
            if ref != code:
                differ.append(name)
            verdict = "no reference" if ref is None else "identical" if ref == code else "DIFFERS"
            print(f"{name}: {verdict} {usage}")
        else:
            print(f"{name}: {len(code.splitlines())} lines {usage}")
    if differ:
        sys.exit(f"PTX differs for: {', '.join(differ)}")


if __name__ == "__main__":
    main()
