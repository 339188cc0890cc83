"""Compile the sparse-attention kernels for sm_90 on any machine (no GPU needed) and write each one's PTX
instruction stream (debug info and labels stripped), so that a refactor can be checked to leave the generated
code unchanged before any GPU time is spent on it; also prints each kernel's registers and stack (spills)
from the compiled cubin.

    python -m benchmarks.kernel_ptx OUT_DIR                 # write OUT_DIR/<config>.ptx
    python -m benchmarks.kernel_ptx OUT_DIR --compare REF   # also report which differ from REF_DIR/<config>.ptx

The attention configs are the committed defaults (long and short rows) at H=16, D=128, block 128, bf16, each
with TMA and with pointer tiles, plus a GQA 4:1 dK/dV; the delta pre-pass and the four selection kernels are
compiled at one representative shape each. Pointers and strides are specialised as divisible by 16, as the
launcher does for contiguous ``[T, H, 128]`` tensors; the local Triton may differ from the GPU machine's, so
registers are indicative.
"""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparsebalance.kernels.sparse_attention import backward, forward, launch, select_kernels
from sparsebalance.sim.core import ArgumentParser, check_writable, one_line_errors

# pointer arguments by name (the attention tensors, the selection's buffers); every other non-constexpr
# argument is an int32 size or stride, except the fp32 scales
POINTERS = {
    **dict.fromkeys(("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"), "*bf16"),
    **dict.fromkeys(("LSE", "DELTA", "QB", "KB", "OUT", "SCR", "budget", "COV", "OUT_COV", "OUT_KEPT",
                     "doc_causal"), "*fp32"),
    **dict.fromkeys(("blk_start", "blk_end", "q2k_start", "q2k_cnt", "q_order", "k2q_ptr", "k2q_start", "k2q_end",
                     "k_order", "OUT_IDX", "OUT_START", "OUT_CNT", "OUT_END", "KCNT", "Q2K_IDX", "Q2K_CNT",
                     "K2Q_PTR", "CNT", "NNZ", "PTR"), "*i32"),
    **dict.fromkeys(("block_doc", "doc_first", "row_offset"), "*i64"),
}
SCALES = ("qk_scale", "sm_scale", "scale")
DESCRIPTORS = ("KD", "VD", "QD", "DOD")  # forward / dQ: K and V tiles; dK/dV: Q and dO tiles


def signature(fn, consts: dict, box: list | None = None) -> dict:
    """Triton signature of a kernel: tensors, index arrays, fp32 scales, int32 sizes and strides, and the
    tensor descriptors (``box``: their block shape) unless they are constants (None: no TMA)."""
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in DESCRIPTORS:
            sig[name] = f"tensordesc<bf16{box}>"
        else:
            sig[name] = POINTERS.get(name, "fp32" if name in SCALES else "i32")
    return sig


def divisible_by_16(fn, sig: dict) -> dict:
    """Specialisation attributes: tensors, index arrays and the (token, head) strides are 16-divisible, as
    the launcher finds them, except the arguments the kernel never specialises (``do_not_specialize``,
    ``do_not_specialize_on_alignment``)."""
    unspecialised = set(fn.do_not_specialize) | set(fn.do_not_specialize_on_alignment)
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
            if (ty.startswith("*") or re.fullmatch(r"s[a-z]{1,3}[th]", name)) and name not in unspecialised}


def resources(cubin: bytes) -> str:
    """``REG:n STACK:bytes`` of a cubin, by the cuobjdump that ships with Triton."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"REG:{m.group(1)} STACK:{m.group(2)}" if m else "REG:? STACK:?"


def attention_jobs():
    """(name, kernel, constexprs, compile options, descriptor box or None) of each attention config, each also
    once with pointer tiles (``_ptr``: what runs where TMA cannot)."""
    kernels = {"fwd": forward._fwd_kernel, "dq": backward._bwd_dq_kernel, "dkdv": backward._bwd_dkdv_kernel}
    for kind, fn in kernels.items():
        params = inspect.signature(fn.fn).parameters
        for suffix, rows, G in (("", 64, 1), ("_short", 8, 1)) + ((("_gqa4", 64, 4),) if kind == "dkdv" else ()):
            cfg = launch.get_config(kind, 128, 128, row_blocks=rows)
            consts = dict(G=G, BLOCK=128, BM=cfg["BM"], BN=cfg["BN"], D=128, PREC="tf32",
                          HEAD_OUTER=cfg["HEAD_OUTER"])
            for ptr in (False, True):
                tma = bool(cfg.get("TMA")) and not ptr
                flags = {"TMA": tma, "WS": tma and cfg.get("WS", False)}
                extra = {k: v for k, v in flags.items() if k in params}
                if not tma:
                    extra.update({d: None for d in DESCRIPTORS if d in params})
                box_rows = cfg["BM"] if kind == "dkdv" else cfg["BN"]
                yield (kind + suffix + ("_ptr" if ptr else ""), fn, {**consts, **extra},
                       launch.compile_options(cfg, tma), [box_rows, 128] if tma else None)


def support_jobs():
    """The same tuples for the delta pre-pass and the selection kernels (launched with Triton's default
    stages), at the shapes of a 16-head, D 128, block 128 selection."""
    sk = select_kernels
    yield "delta", backward._delta_kernel, dict(BT=backward.DELTA_TOKENS, D=128), dict(num_warps=4), None
    yield "pool", sk._pool_kernel, dict(G=1, BLOCK=128, D=128), dict(num_warps=4), None
    for name, topp, wp2, warps in (("select_topk", False, 256, 4), ("select_topp_wide", True, 1024, 8)):
        yield name, sk._select_kernel, dict(HKV=16, TOPP=topp, D=128, CH=64, WP2=wp2), dict(num_warps=warps), None
    yield "reverse", sk._reverse_kernel, dict(CH=64), dict(num_warps=2), None
    yield "doc_stats", sk._doc_stats_kernel, dict(CH=64, SCH=1024), dict(num_warps=4), None


def compile_ptx(fn, consts: dict, options: dict, box: list | None):
    """(PTX instructions, register/stack usage) of one kernel compiled for sm_90."""
    sig = signature(fn, consts, box)
    src = ASTSource(fn=fn, signature=sig, constexprs={(list(sig).index(k),): v for k, v in consts.items()},
                    attrs=divisible_by_16(fn, sig))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return instructions(compiled.asm["ptx"]), resources(compiled.asm["cubin"])


def instructions(ptx: str) -> str:
    """The PTX code without its DWARF sections, source locations, comments and debug labels (all of which
    move with source lines)."""
    code = ptx.split(".section", 1)[0]
    lines = (line.split("//")[0].rstrip() for line in code.splitlines())
    return "\n".join(line for line in lines if line and not line.lstrip().startswith((".loc", ".file"))
                     and not re.fullmatch(r"\$L__tmp\d+:", line)) + "\n"


def verdict(name: str, code: str, ref_dir: str | None) -> str:
    """What one config's PTX is against ``ref_dir`` (or its size when there is no reference directory)."""
    if ref_dir is None:
        return f"{len(code.splitlines())} lines"
    ref_path = os.path.join(ref_dir, name + ".ptx")
    if not os.path.exists(ref_path):
        return "no reference"
    with open(ref_path) as f:
        return "identical" if f.read() == code else "DIFFERS"


@one_line_errors
def main():
    ap = ArgumentParser(prog="python -m benchmarks.kernel_ptx", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", metavar="OUT_DIR")
    ap.add_argument("--compare", metavar="REF_DIR")
    args = ap.parse_args()
    if args.compare and not os.path.isdir(args.compare):
        ap.error(f"--compare {args.compare!r} is not a directory (write one first: "
                 "python -m benchmarks.kernel_ptx REF_DIR)")
    check_writable(args.out, "OUT_DIR", directory=True)  # before any kernel compiles
    os.makedirs(args.out, exist_ok=True)
    differ = []
    for name, fn, consts, options, box in (*attention_jobs(), *support_jobs()):
        code, usage = compile_ptx(fn, consts, options, box)
        with open(os.path.join(args.out, name + ".ptx"), "w") as f:
            f.write(code)
        result = verdict(name, code, args.compare)
        if result in ("DIFFERS", "no reference"):
            differ.append(name)
        print(f"{name}: {result} {usage}")
    if differ:
        sys.exit(f"PTX differs from the reference (or has none) for: {', '.join(differ)}")


if __name__ == "__main__":
    main()
