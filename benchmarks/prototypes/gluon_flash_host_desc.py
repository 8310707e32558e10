"""The flash family's gluon_ws forward with its TMA descriptors built on the host, beside the family's own (built on
the device in every program), and cuDNN, timed in one run.

Why: the GEMM family's TMA kernels ran 3-20% faster once their descriptors were kernel parameters built on the host
(results/gluon_gemm_host_desc_2026-12-04.txt; benchmarks/RESULTS.md, twenty-third run). The flash forward still
builds four (Q, K, V, O) in every persistent program. Its short prefill runs 0.92-0.95x of SDPA's best backend.
The host variant is the rendered dense kernel with those four statements replaced by parameters (a source patch, as
gluon_flash_variants.py patches); the descriptors are encoded once and handed to Triton's C launcher
(autotile.launch.bind_descriptors), so neither way pays descriptor work on the host per call. Each variant's output
is compared with cuDNN's first (bf16 tolerance).

    python benchmarks/prototypes/gluon_flash_host_desc.py            # on a Hopper GPU, ~1 min
    env -u TRITON_INTERPRET python benchmarks/prototypes/gluon_flash_host_desc.py --compile-only   # any machine: sm90
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

from autotile.families.flash import FAMILY, FlashProblem, default_scale  # noqa: E402
from autotile.families.flash_launch import forward_plan  # noqa: E402
from autotile.space import Config  # noqa: E402

# (label, batch, heads_q, heads_kv, seq, head_dim, causal): the short prefills and the shapes of issue 14's targets.
SHAPES = (("llama 16x512 causal", 16, 32, 8, 512, 128, True), ("D=64 3x12x2000 causal", 3, 12, 12, 2000, 64, True),
          ("gemma 16x512 causal", 16, 16, 8, 512, 256, True), ("llama 4x2048 causal", 4, 32, 8, 2048, 128, True),
          ("D=128 2x32x4096", 2, 32, 32, 4096, 128, False))
_DESCRIPTORS = ("q_desc", "k_desc", "v_desc", "o_desc")
_SIGNATURE = "def attn_fwd(\n"
# The rendered dense kernel's WG_ROWS (the O store's rows: a consumer warpgroup's).
_O_ROWS = 64


def problem_of(batch, heads_q, heads_kv, seq, head_dim, causal) -> FlashProblem:
    return FlashProblem("fwd", batch, heads_q, heads_kv, seq, seq, head_dim, causal)


def host_desc_module(problem, config: Config):
    """The family's rendered gluon_ws forward with q_desc, k_desc, v_desc and o_desc taken as its first parameters."""
    module = FAMILY.kernel_module(problem, config, interpret=False, store_lse=False)
    source = Path(module.__file__).read_text()
    assert source.count(_SIGNATURE) == 1, "attn_fwd's signature moved: update _SIGNATURE"
    source = source.replace(_SIGNATURE, _SIGNATURE + "    " + ", ".join(f"{d}_host" for d in _DESCRIPTORS) + ",\n")
    for name in _DESCRIPTORS:
        match = re.search(rf"^    {name} = tma\.make_tensor_descriptor\(", source, flags=re.M)
        assert match, f"{name} is no longer built as this patch expects (a dense problem's kernel)"
        depth, end = 1, match.end()
        while depth:  # to the statement's closing parenthesis
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        source = source[:match.start()] + f"    {name} = {name}_host" + source[end:]
    path = Path(tempfile.mkdtemp()) / "gluon_flash_host_desc.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)
    return patched


def host_descriptors(config, q, k, v, o) -> list:
    """TensorDescriptors of dense (B, H, S, D) q, k, v and o with the kernel's blocks and layouts."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]
    d = q.shape[-1]
    q_block, kv_block, o_block = [1, 1, config["BLOCK_M"], d], [1, 1, config["BLOCK_N"], d], [1, 1, _O_ROWS, d]
    q_layout = gl.NVMMASharedLayout.get_default_for(q_block, gl_dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_block, gl_dtype)  # O leaves through a K/V slot: its layout
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
            for t, block, layout in ((q, q_block, q_layout), (k, kv_block, kv_layout), (v, kv_block, kv_layout),
                                     (o, o_block, kv_layout))]


def host_launch_args(problem, config, module, q, k, v, o, lse) -> tuple:
    """(kernel, grid, args, options) of one host-descriptor launch: the family's forward plan's, descriptors first."""
    plan = forward_plan(module, problem, config, default_scale(problem.head_dim), q, k, v, o, lse, None, False)
    fwd = plan.fwd
    args = (*host_descriptors(config, q, k, v, o), q, k, v, o, lse, lse, lse, lse, lse, *fwd.scalars)
    return module.attn_fwd, fwd.grid, args, fwd.options


def compile_variants(shapes=SHAPES) -> list[dict]:
    """Cross-compile each shape's host-descriptor default for sm90 on CPU tensors (no GPU): the patch applies and the
    kernel builds. One dict a shape: label, shared bytes, global scratch bytes."""
    from triton.backends.compiler import GPUTarget

    from autotile.device import planned_device
    from autotile.xcompile import compile_kernel

    h200 = planned_device("h200")
    out = []
    for label, *dims in shapes:
        p = problem_of(*dims)
        config = FAMILY.default_config(p, h200)
        if config["LOADS"] != "gluon_ws":
            out.append({"label": label, "skipped": f"the default is {config['LOADS']}"})
            continue
        module = host_desc_module(p, config)
        q = torch.empty(p.batch, p.heads_q, p.seq_q, p.head_dim, dtype=torch.bfloat16)
        k, v = (torch.empty(p.batch, p.heads_kv, p.seq_k, p.head_dim, dtype=torch.bfloat16) for _ in range(2))
        o, lse = torch.empty_like(q), torch.empty(p.batch, p.heads_q, p.seq_q)
        with _sm_count(h200.sm_count):
            kernel, _, args, options = host_launch_args(p, config, module, q, k, v, o, lse)
        compiled, _ = compile_kernel(kernel, GPUTarget("cuda", 90, 32), args, options)
        out.append({"label": label, "shared": compiled.metadata.shared,
                    "scratch": compiled.metadata.global_scratch_size})
    return out


class _sm_count:
    """forward_plan sizes the persistent grid by the device's SMs: on a CPU, say the H200's."""

    def __init__(self, count: int):
        self.count = count

    def __enter__(self):
        import autotile.families.flash_launch as flash_launch

        self._module, self._before = flash_launch, flash_launch.current_device
        flash_launch.current_device = lambda dev: type("Device", (), {"sm_count": self.count})()

    def __exit__(self, *exc):
        self._module.current_device = self._before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.compile_only:
        for built in compile_variants():
            print(built, flush=True)
        return 0
    import triton
    from gluon_flash_variants import inputs_and_cudnn
    from triton.testing import do_bench

    from autotile.device import cuda_device
    from autotile.launch import bind_descriptors

    device = cuda_device(0)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}; TFLOP/s and x "
          f"cuDNN, L2 flushed, medians of {args.rounds} interleaved rounds", flush=True)
    failures = 0
    for label, *dims in SHAPES:
        p = problem_of(*dims)
        config = FAMILY.default_config(p, device)
        if config["LOADS"] != "gluon_ws":
            print(f"{label}: the default is {config['LOADS']}, skipped", flush=True)
            continue
        q, k, v, cudnn = inputs_and_cudnn(p)
        scale = default_scale(p.head_dim)
        want = cudnn()
        lse = torch.empty(p.batch, p.heads_q, p.seq_q, device="cuda", dtype=torch.float32)
        o_device, o_host = torch.empty_like(q), torch.empty_like(q)
        module = FAMILY.kernel_module(p, config, interpret=False, store_lse=False)
        plan = forward_plan(module, p, config, scale, q, k, v, o_device, lse, None, False, keep=True)
        kernel, grid, launch_args, options = host_launch_args(p, config, host_desc_module(p, config), q, k, v, o_host,
                                                               lse)
        launcher, encoders = bind_descriptors(kernel, grid, *launch_args, **options)
        encoded = [x for encode, t in zip(encoders, (q, k, v, o_host)) for x in encode(t)]
        rest = launch_args[len(encoders):]
        fns = {"cudnn": cudnn,
               "device-built": lambda: plan(q, k, v, o_device, lse, lse, lse, lse, lse),
               "host-built": lambda: launcher(*encoded, *rest)}
        fns["device-built"]()
        fns["host-built"]()
        for name, o in (("device-built", o_device), ("host-built", o_host)):
            err = (o.float() - want.float()).abs().max().item()
            if not err < 3e-2:
                failures += 1
                print(f"FAILED {label} {name}: differs from cuDNN by {err:.3g}", flush=True)
                fns.pop(name)
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(do_bench(fn, warmup=10, rep=40, return_mode="median"))
        best = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
        pairs = p.seq_q * p.seq_k - (p.seq_q * (p.seq_q - 1) // 2 if p.causal else 0)
        flops = 4 * p.batch * p.heads_q * pairs * p.head_dim
        print(f"{label} ({config['BLOCK_M']}x{config['BLOCK_N']} s{config['num_stages']}): " + ", ".join(
            f"{name} {flops / ms / 1e9:.0f} ({best['cudnn'] / ms:.3f}x)" for name, ms in best.items()), flush=True)
    print(f"{failures} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
