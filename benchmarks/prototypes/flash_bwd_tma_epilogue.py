"""A/B of the Gluon backward's dK/dV stores: `gl.store` from registers (the family's) against TMA stores through
each warpgroup's dQ staging buffer (this script's source patch of the rendered templates/flash_gluon_bwd.py.j2).

Why: with %globaltimer stamps (flash_bwd_tile_clock.py; results/flash_bwd_tile_clock_2026-12-04.txt) a tile's dK/dV
stores took 5.5-6.6 us, against 2.3 us a step: 4-byte stores from the wgmma layout, 64 a thread. The patch stores
a warpgroup's 64 x BLOCK_D block (bf16: 16 KB at head dim 128, the size of its fp32 dQ staging buffer) into that
buffer, reinterpreted, and sends it with a TMA store (rows past Sk and columns past D are clipped by TMA), dK then dV.
Dense calls with one program a tile only (SPLIT == 1); the rest keep the family's stores.
On a Hopper GPU (checks each variant's gradients against plain torch in fp32, then times both beside cuDNN):
    PYTHONPATH=. python benchmarks/prototypes/flash_bwd_tma_epilogue.py [--shapes LABEL,...]
On a CPU, --compile-only checks that the patched kernel compiles for sm90.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotile import render  # noqa: E402
from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem  # noqa: E402

SHAPES = {
    "4x32x2048": FlashProblem("bwd", 4, 32, 32, 2048, 2048, 128),
    "2x32x4096 causal": FlashProblem("bwd", 2, 32, 32, 4096, 4096, 128, causal=True),
    "2x32x4096": FlashProblem("bwd", 2, 32, 32, 4096, 4096, 128),
    "16x32x512 causal": FlashProblem("bwd", 16, 32, 32, 512, 512, 128, causal=True),
    "Llama-3-8B 16x512": FlashProblem("bwd", 16, 32, 8, 512, 512, 128, causal=True),
    "Llama-3-8B 1x4096": FlashProblem("bwd", 1, 32, 8, 4096, 4096, 128, causal=True),
    "D64 4x32x2048 causal": FlashProblem("bwd", 4, 32, 32, 2048, 2048, 64, causal=True),
    "Phi-3 (D96) 4x32x1024 causal": FlashProblem("bwd", 4, 32, 32, 1024, 1024, 96, causal=True),
}
CONFIG = dict(LOADS=GLUON_WS, BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=64, BLOCK_N2=128, num_warps=4, num_stages=2)

DESCRIPTORS = '''
    out_block: gl.constexpr = [1, 1, WG_KEYS, BLOCK_D]
    out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(out_block, dk_ptr.dtype.element_ty)
    dk_desc = tma.make_tensor_descriptor(dk_ptr, [batch, heads_kv, rows_k, HEAD_DIM],
                                         [stride_dkb, stride_dkh, stride_dks, 1], out_block, out_layout)
    dv_desc = tma.make_tensor_descriptor(dv_ptr, [batch, heads_kv, rows_k, HEAD_DIM],
                                         [stride_dvb, stride_dvh, stride_dvs, 1], out_block, out_layout)
'''
EPILOGUE = '''            if SPLIT == 1:
                # dK and dV through this warpgroup's dQ staging buffer, by TMA (rows past Sk clipped).
                tma.store_wait(0)  # the last dQ reduction has read the buffer
                out_buf = dq_buf._reinterpret(dk_desc.dtype, dk_desc.block_type.shape, dk_desc.layout)
                out_rows2 = out_buf.reshape([WG_KEYS, BLOCK_D])
                out_rows2.store((dk * sm_scale).to(dk_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(dk_desc, [b, h_kv, key0, 0], out_buf)
                tma.store_wait(0)
                out_rows2.store(dv.to(dv_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(dv_desc, [b, h_kv, key0, 0], out_buf)
            else:
'''


def patch(source: str) -> str:
    if "def attn_bwd_gluon(" not in source:
        return source
    assert source.count("dq_desc, dq_smem, dk_ptr") == 3, "the consumer's signature and its two calls"
    source = source.replace("dq_desc, dq_smem, dk_ptr", "dq_desc, dq_smem, dk_desc, dv_desc, dk_ptr")
    anchor = "    dq_desc = tma.make_tensor_descriptor(dq_ptr,"
    at = source.index(anchor)
    end = source.index("\n", at) + 1
    source = source[:end] + DESCRIPTORS + source[end:]
    start = source.index("            out_rows = key0 + gl.arange(0, WG_KEYS")
    stop = source.index("            t += 1\n        work += 1\n    tma.store_wait(0)\n")
    body = "".join("    " + line + "\n" for line in source[start:stop].splitlines())
    return source[:start] + EPILOGUE + body + source[stop:]


def patched_render():
    plain = render.render_source

    def render_source(template: str, **switches) -> str:
        source = plain(template, **switches)
        return patch(source) if not switches.get("VARLEN") else source
    return render_source


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    wanted = [w for w in args.shapes.split(",") if w]
    shapes = {k: p for k, p in SHAPES.items() if not wanted or any(w in k for w in wanted)}
    if args.compile_only:
        from autotile import xcompile
        from autotile.device import planned_device

        render.render_source = patched_render()
        for label, problem in shapes.items():
            builds = xcompile.compile_config(FAMILY, problem, CONFIG, planned_device("h200"))
            main_build = next(k for k in builds if k.name == "attn_bwd_gluon")
            print(f"{label}: compiled for sm90, shared {main_build.shared}, "
                  f"key-loop spills {main_build.mma_loop_spills}")
        return 0
    import datetime

    import torch
    import triton

    from autotile.device import cuda_device
    from flash_bench import kernel_call, sdpa_calls
    from flash_bwd_bench import gross_check, timed_cells

    device = cuda_device()
    plain = render.render_source
    print(f"# dK/dV by gl.store (family) or TMA (patched), {datetime.date.today()}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__}; TFLOP/s (x cuDNN)", flush=True)
    for label, problem in shapes.items():
        inputs = FAMILY.make_inputs(problem, device, seed=0)
        fns = {}
        for name, source in (("family", plain), ("tma epilogue", patched_render())):
            render.render_source = source
            render._loaded.clear()  # NOTE: the module memo is keyed by switches alone; a kept plan keeps its kernels
            print(f"  {label} {name}: {gross_check(problem, CONFIG, inputs)}", flush=True)
            fns[name] = kernel_call(problem, CONFIG, inputs)
        render.render_source = plain
        fns.update({k: f for k, f in sdpa_calls(problem, inputs).items() if "cuDNN" in k})
        print(f"{label}: {timed_cells(problem, fns, args.rounds, digits=3)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
