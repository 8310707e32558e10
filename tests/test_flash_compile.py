"""Every flash kernel variant compiles for the GPUs it is meant for, checked on the CPU.

Triton compiles for an explicit target with the ptxas it ships, so GPU compile errors (layouts, shared
memory, warp specialisation, TMA descriptors) show up here without a GPU: sm90 for every variant,
sm80 for the pointer-load ones (TMA and warp specialisation are Hopper's). The compiles run in one
child process: this test process set TRITON_INTERPRET=1 before Triton was imported, and Triton fixes
at import whether its own language helpers are compiled or interpreted.
"""
from __future__ import annotations

import json
import re

import pytest
from compile_child import map_in_processes, run_compile_child
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from autotile.device import DeviceInfo
from autotile.families.flash import FAMILY, FlashProblem
from autotile.space import Config

# The H200's limits as cuda_device() reports them, for the feasibility check.
_H200 = DeviceInfo("h200", "NVIDIA H200", (9, 0), 132, 150_000_000_000, 232448, "test")
_POINTER = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32", "fp8": "*fp8e4nv"}


def _argument_type(problem: FlashProblem, name: str) -> str:
    if name in ("q_ptr", "k_ptr", "v_ptr"):
        return _POINTER[problem.dtype]
    if name in ("o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr"):
        return _POINTER[problem.out_dtype]
    if name in ("lse_ptr", "delta_ptr", "descale_ptr", "alibi_ptr"):
        return "*fp32"
    if name in ("cu_q_ptr", "cu_k_ptr"):
        return "*i32" if problem.varlen else "*fp32"
    if name in ("sm_scale", "softcap"):
        return "fp32"
    return "i32"


def compile_for(problem: FlashProblem, config: Config, arch: int) -> list:
    """Compile each kernel `config` launches for `problem` (as a CUDA run would render it) for sm`arch`; returns
    the CompiledKernels."""
    module = FAMILY.kernel_module(problem, config, interpret=False)
    dims = dict(HEAD_DIM=problem.head_dim, BLOCK_D=problem.block_d)
    if problem.direction == "fwd":
        kernels = [("attn_fwd", dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
                                     WARP_SPECIALIZE=config["WARP_SPECIALIZE"], NEGATE_Q=False))]
    else:
        kernels = [("attn_bwd_preprocess", dict(BLOCK_M=config["BLOCK_M2"])),
                   ("attn_bwd_dkdv", dict(BLOCK_M1=config["BLOCK_M1"], BLOCK_N1=config["BLOCK_N1"])),
                   ("attn_bwd_dq", dict(BLOCK_M2=config["BLOCK_M2"], BLOCK_N2=config["BLOCK_N2"]))]
    built = []
    for name, constants in kernels:
        fn = getattr(module, name)
        constants = dict(constants, **dims)
        signature = {arg: "constexpr" if arg in constants else _argument_type(problem, arg) for arg in fn.arg_names}
        source = ASTSource(fn=fn, signature=signature,
                           constexprs={(fn.arg_names.index(arg),): value for arg, value in constants.items()})
        built.append(triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                    options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]}))
    return built


# A Hopper MMA reading its A operand from shared memory: in the forward only Q can (P is computed in registers).
_DOT_FROM_SHARED = re.compile(r"warp_group_dot [^\n]*\} : !ttg\.memdesc")


def q_problem(problem: FlashProblem, arch: int, built: list) -> str:
    """'' or what is wrong: an sm90 forward must feed its Q K^T MMAs the Q tile from shared memory, where it
    landed. A register Q (a runtime branch on Q did that) cost 24-38 registers a thread and a copy of the tile."""
    if problem.direction != "fwd" or arch < 90 or _DOT_FROM_SHARED.search(built[0].asm["ttgir"]):
        return ""
    return "the forward's Q K^T MMAs read Q from registers, not from shared memory"


def _fwd(loads="pointer", block_m=128, block_n=64, ws=False, warps=8, stages=3, lookahead=False,
         masks_in_loop=False) -> Config:
    return Config(LOADS=loads + ("_lookahead" if lookahead else ""), BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=ws,
                  MASKS_IN_LOOP=masks_in_loop, num_warps=warps, num_stages=stages)


BWD = Config(LOADS="pointer", BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=2)

# Each compile takes 3-30 s on a CI core (the backward's three kernels the longest), so sm80 is checked
# on one pointer-load variant; every Hopper-only path (TMA, warp specialisation, 256-key blocks) on sm90.
VARIANTS = [
    # (id, problem, config, archs)
    ("plain-tma-ws-d128", FlashProblem("fwd", 2, 32, 8, 4096, 4096, 128, causal=True), _fwd("tma", 128, 128, True, 8, 2), (90,)),
    ("plain-pointer-d96", FlashProblem("fwd", 1, 32, 32, 4096, 4096, 96, causal=True), _fwd(), (80,)),
    ("lookahead-tma", FlashProblem("fwd", 2, 32, 8, 4096, 4096, 128, causal=True),
     _fwd("tma", 128, 128, False, 8, 2, lookahead=True), (90,)),
    ("lookahead-tma-ws", FlashProblem("fwd", 2, 32, 8, 4096, 4096, 128, causal=False),
     _fwd("tma", 128, 128, True, 8, 2, lookahead=True), (90,)),
    # The causal diagonal masked inside the pipelined loop (short prefill's tiles), with pointer and TMA loads.
    ("masks-in-loop-pointer", FlashProblem("fwd", 16, 32, 8, 512, 512, 128, causal=True),
     _fwd("pointer", 64, 64, False, 4, 3, masks_in_loop=True), (90,)),
    ("masks-in-loop-tma-window", FlashProblem("fwd", 2, 16, 8, 4096, 4096, 128, causal=True, window_left=1024),
     _fwd("tma", 128, 64, False, 8, 2, masks_in_loop=True), (90,)),
    ("d64-wide-key-blocks", FlashProblem("fwd", 3, 12, 12, 2000, 2000, 64, causal=True), _fwd("tma", 128, 256, False, 8, 2), (90,)),
    ("d256-tma", FlashProblem("fwd", 1, 16, 8, 8192, 8192, 256, causal=True), _fwd("tma", 64, 64, False, 4, 2), (90,)),
    ("features-pointer", FlashProblem("fwd", 2, 16, 8, 4096, 4096, 128, causal=True, window_left=1024, softcap=50.0,
                                      alibi=True), _fwd(), (90,)),
    ("varlen-tma-ws", FlashProblem("fwd", 8, 32, 8, 2048, 2048, 128, causal=True, varlen=True),
     _fwd("tma", 128, 128, True, 8, 2), (90,)),
    ("fp8-tma", FlashProblem("fwd", 2, 32, 32, 4096, 4096, 128, causal=True, dtype="fp8"), _fwd("tma", 128, 128, False, 8, 2), (90,)),
    # Warp-specialised 128 x 128 TMA tiles over a padded head dim (96 in 128 lanes: the Triton template's, where
    # gluon_ws, the Hopper default whose builds tests/test_flash_gluon.py checks, does not apply), and D = 256 on the
    # 128 x 64 tiles of 8 warps that the untuned rule gives where gluon_ws does not apply.
    ("noncausal-d96-tma-ws", FlashProblem("fwd", 2, 32, 32, 4096, 4096, 96), _fwd("tma", 128, 128, True, 8, 3), (90,)),
    ("tma-d256", FlashProblem("fwd", 1, 16, 8, 4096, 4096, 256), _fwd("tma", 128, 64, False, 8, 2), (90,)),
    ("bwd-plain-d128", FlashProblem("bwd", 2, 32, 8, 4096, 4096, 128, causal=True), BWD, (90,)),
    # The backward's TMA loads (per-sequence descriptors of packed rows) with every feature's masks.
    ("bwd-varlen-features-tma", FlashProblem("bwd", 4, 16, 8, 2048, 2048, 128, causal=True, window_left=512, softcap=30.0,
                                         alibi=True, varlen=True), Config(BWD, LOADS="tma"), (90,)),
]


def _compile_variant(variant: tuple) -> tuple[str, str]:
    name, problem, config, archs = variant
    try:
        for arch in archs:
            problem_text = q_problem(problem, arch, compile_for(problem, config, arch))
            if problem_text:
                return name, problem_text
        return name, "ok"
    except Exception as exc:  # noqa: BLE001 - reported per variant by the tests
        return name, f"{type(exc).__name__}: {str(exc)[-2000:]}"


def _compile_all() -> dict[str, str]:
    """{variant id: "ok" or the compile error}, compiling every variant for each of its archs."""
    # The backward's three kernels first, the longest compiles, so neither process is left with one at the end.
    ordered = sorted(VARIANTS, key=lambda v: v[1].direction != "bwd")
    return dict(map_in_processes(_compile_variant, ordered))


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    return run_compile_child(__file__, timeout=600)


@pytest.mark.parametrize("problem, config, archs", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_variant_is_in_the_space(problem, config, archs):
    assert FAMILY.space(problem, _H200).is_feasible(config), FAMILY.space(problem, _H200).violations(config)


@pytest.mark.parametrize("name", [v[0] for v in VARIANTS])
def test_variant_compiles_for_the_gpu(compiled, name):
    assert compiled[name] == "ok", compiled[name]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
