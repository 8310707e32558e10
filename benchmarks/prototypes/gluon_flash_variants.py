"""Variants of the flash family's gluon_ws forward timed side by side with cuDNN, in one run.

A variant is a config of the family and optionally a patch of the rendered kernel's source: the template's changes
are timed against what they replace (the patch puts that back). Each variant's output is compared with cuDNN's
(bf16 tolerance; the float64 checks are tests/test_flash_gluon_gpu.py's), then all are timed interleaved: medians
of do_bench medians over --rounds; every shape also times the family's default config.
On a Hopper GPU:
    python benchmarks/prototypes/gluon_flash_variants.py
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from autotile.families.flash import FAMILY, GLUON_WS, FlashProblem, default_scale  # noqa: E402
from autotile.families.flash_launch import forward_plan  # noqa: E402
from autotile.space import Config  # noqa: E402

# Source patches, (old, new) text of the rendered kernel. scale_first: the softmax as it was before the FFMA form
# (the logits scaled before their row maxima are taken, then a subtract), which the template keeps for negative
# scales only: 2026-12-03 it ran 0.87x of cuDNN where the FFMA form ran 0.97x (D = 128, 2 x 32 x 4096).
# forwards: every round deals the tiles out in program order (the schedule before odd rounds went backwards; it
# ran 0.91-0.93x of the alternating one on causal shapes, results/gluon_variants_2026-12-03b.txt).
# gl_store: dense O stored from the wgmma's registers, as before it left through a key block's slot and a TMA store
# (1.0-1.17x with 128-key blocks, results/gluon_variants_2026-12-03c.txt).
# one_q_slot: one Q slot where the family renders two (64-key blocks; 2026-12-03 two led by 0-2%,
# results/gluon_variants_2026-12-03e.txt). all_blocks: both warpgroups read all of a causal tile's key blocks, as
# before each read its own (0.88x -> 0.93x of cuDNN at 16 x 512, same file). head_major: causal tiles one head after
# another, each head's query tiles heaviest first (the order L2 favours; ncu: 39% L2 hits at Gemma-2-9B 4 x 2048 for
# the tile-major order, cuDNN 72%), which the template takes at head dim 256 up to 16 query tiles a head; head_major
# takes it at every head dim and tile_major never.
# A patch is (old, new), or (first line, line after, new) for the text from the first line up to the line after;
# patches join with '+'. The tile queue (TILE_QUEUE: tiles taken from an atomic counter by whichever program is free)
# is a config axis of the family; `--set queue` times every shape's default with the queue on and off.
_REGISTER_STORE = """            mbarrier.arrive(empty.index(last), count=1)
            rows_o = row0 + gl.arange(0, WG_ROWS, layout=row_o)
            o_base = o_ptr + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
            offsets = (q_first + rows_o).to(gl.int64)[:, None] * stride_os + dims[None, :]
            gl.store(o_base + offsets, acc.to(o_ptr.dtype.element_ty), mask=(rows_o < len_q)[:, None])
"""
PATCHES = {"scale_first": ("    if NEGATE_Q:\n", "    if True:  # scale first, whatever the scale's sign\n"),
           "forwards": ("    return r * P + pid + (r % 2) * (P - 1 - 2 * pid)\n", "    return r * P + pid\n"),
           "gl_store": ("            if O_IN_V:\n", "            it += n_blocks\n", _REGISTER_STORE),
           "head_major": ("    if BLOCK_D == 256 and n_m <= HEAD_MAJOR_TILES:\n", "    if n_m <= HEAD_MAJOR_TILES:\n"),
           "tile_major": ("    if BLOCK_D == 256 and n_m <= HEAD_MAJOR_TILES:\n", "    if False:\n"),
           "one_q_slot": ("Q_SLOTS = gl.constexpr(2)\n", "Q_SLOTS = gl.constexpr(1)\n"),
           "all_blocks": ("mine = _key_blocks(row0 + WG_ROWS, len_q, len_k, win_right, BLOCK_N)",
                          "mine = n_blocks"),
}


def gluon(block_m: int, block_n: int, stages: int, queue: bool = False) -> Config:
    return Config(dict(LOADS=GLUON_WS, BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=False, MASKS_IN_LOOP=False,
                       TILE_QUEUE=queue, num_warps=4, num_stages=stages))


def triton(loads: str, block_m: int, block_n: int, warps: int, stages: int, masks_in_loop: bool = False) -> Config:
    return Config(dict(LOADS=loads, BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=False,
                       MASKS_IN_LOOP=masks_in_loop, num_warps=warps, num_stages=stages))


# (label, problem, {variant name: (config, patch or None)}); every shape also times the family's default config.
def cases() -> list:
    def p(b, hq, hkv, s, sk, d, causal):
        return FlashProblem("fwd", b, hq, hkv, s, sk, d, causal)

    causal = {"gluon 128x128 s3": (gluon(128, 128, 3), None),
              "gluon 128x128 s3 queue": (gluon(128, 128, 3, queue=True), None),
              "gluon 128x64 s4": (gluon(128, 64, 4), None),
              "gluon 128x64 s4 queue": (gluon(128, 64, 4, queue=True), None),
              "gluon 128x64 s4 one_q_slot": (gluon(128, 64, 4), "one_q_slot"),
              "gluon 128x64 s4 all_blocks": (gluon(128, 64, 4), "all_blocks")}
    d128 = {"gluon 128x128 s3": (gluon(128, 128, 3), None),
            "gluon 128x64 s4": (gluon(128, 64, 4), None)}
    d64 = {"gluon 128x128 s3": (gluon(128, 128, 3), None),
           "gluon 128x64 s4": (gluon(128, 64, 4), None)}
    d256 = {"gluon 128x64 s2": (gluon(128, 64, 2), None),
            "gluon 128x128 s1 split": (gluon(128, 128, 1), None),
            "gluon 128x128 s1 split queue": (gluon(128, 128, 1, queue=True), None),
            "gluon 128x128 s1 split tile_major": (gluon(128, 128, 1), "tile_major")}
    # Not causal: the Triton forward that served head dim 256 from 4096 keys beside gluon_ws's two tilings.
    d256_plain = {"gluon 128x64 s2": (gluon(128, 64, 2), None), "gluon 128x128 s1 split": (gluon(128, 128, 1), None),
                  "tma 128x64 w8 s2": (triton("tma", 128, 64, 8, 2), None)}
    d256_short = {"gluon 128x64 s2": (gluon(128, 64, 2), None), "gluon 128x64 s2 queue": (gluon(128, 64, 2, True), None),
                  "gluon 128x128 s1 split": (gluon(128, 128, 1), None)}
    d96_causal = {"gluon 128x128 s3": (gluon(128, 128, 3), None),
                  "gluon 128x64 s4": (gluon(128, 64, 4), None),
                  "pointer 64x64 w4 s3 in-loop": (triton("pointer", 64, 64, 4, 3, masks_in_loop=True), None)}
    major = {"gluon 128x128 s3": (gluon(128, 128, 3), None),
             "gluon 128x128 s3 head_major": (gluon(128, 128, 3), "head_major")}
    return [
        ("llama 1x4096 causal", p(1, 32, 8, 4096, 4096, 128, True), causal),
        ("llama 1x1025 causal", p(1, 32, 8, 1025, 1025, 128, True), causal),
        ("llama 4x2048 causal", p(4, 32, 8, 2048, 2048, 128, True), causal),
        ("llama 4x2048 major", p(4, 32, 8, 2048, 2048, 128, True), major),
        ("llama 1x8192 major", p(1, 32, 8, 8192, 8192, 128, True), major),
        ("llama 16x512 major", p(16, 32, 8, 512, 512, 128, True),
         {"gluon 128x64 s4": (gluon(128, 64, 4), None), "gluon 128x64 s4 head_major": (gluon(128, 64, 4), "head_major")}),
        ("llama 16x512 causal", p(16, 32, 8, 512, 512, 128, True), causal),
        ("qwen 8x1024 causal", p(8, 28, 4, 1024, 1024, 128, True), causal),
        ("D=128 2x32x4096", p(2, 32, 32, 4096, 4096, 128, False), d128),
        ("GQA 16/4 1000x3000", p(1, 16, 4, 1000, 3000, 128, False), d128),
        ("D=64 3x12x2000 causal", p(3, 12, 12, 2000, 2000, 64, True), d64),
        ("D=64 16x512 causal", p(16, 32, 8, 512, 512, 64, True), d64),
        ("gemma 4x2048 causal", p(4, 16, 8, 2048, 2048, 256, True), d256),
        ("gemma 1x8192 causal", p(1, 16, 8, 8192, 8192, 256, True), d256),
        ("gemma 16x512 causal", p(16, 16, 8, 512, 512, 256, True), d256),
        ("gemma 1x4096 causal", p(1, 16, 8, 4096, 4096, 256, True), d256),
        ("gemma 8x1024 causal", p(8, 16, 8, 1024, 1024, 256, True), d256_short),
        ("gemma 1x8192 not causal", p(1, 16, 8, 8192, 8192, 256, False), d256_plain),
        ("gemma 2x4096 not causal", p(2, 16, 8, 4096, 4096, 256, False), d256_plain),
        # Phi-3's head dim 96 in 128-wide tiles, beside the Triton forward that served it before (pointer loads,
        # 64 x 64 tiles, masks in the loop; non-causal: warp-specialised TMA 128 x 128).
        ("phi 16x512 causal", p(16, 32, 32, 512, 512, 96, True), d96_causal),
        ("phi 4x2048 causal", p(4, 32, 32, 2048, 2048, 96, True), d96_causal),
        ("phi 1x4096 causal", p(1, 32, 32, 4096, 4096, 96, True), d96_causal),
        ("phi 2x4096", p(2, 32, 32, 4096, 4096, 96, False),
         {"gluon 128x128 s3": (gluon(128, 128, 3), None), "tma ws 128x128 w8 s3": (Config(dict(
             LOADS="tma", BLOCK_M=128, BLOCK_N=128, WARP_SPECIALIZE=True, MASKS_IN_LOOP=False, num_warps=8,
             num_stages=3)), None)}),
    ]


def queue_cases(device) -> list:
    """Prefill of Llama-3-8B (32/8 heads), Qwen2.5-7B (28/4), Phi-3-mini (32/32, head dim 96), Gemma-2-9B (16/8, 256)
    and head dim 64 over batch sizes, causal and not: each shape's default config with the tile queue on and off
    (head dim 256 on 64-key blocks: also one split slot of 128 keys, both ways)."""
    heads = {"llama": (32, 8, 128), "qwen": (28, 4, 128), "phi": (32, 32, 96), "gemma": (16, 8, 256),
             "d64": (12, 12, 64)}
    shapes = [("llama", 1, 4096, True), ("llama", 1, 8192, True), ("llama", 2, 4096, True), ("llama", 4, 2048, True),
              ("llama", 8, 1024, True), ("llama", 16, 512, True), ("llama", 32, 256, True), ("llama", 2, 4096, False),
              ("llama", 16, 512, False), ("qwen", 1, 4096, True), ("qwen", 4, 2048, True), ("qwen", 8, 1024, True),
              ("qwen", 16, 512, True), ("phi", 4, 2048, True), ("phi", 16, 512, True), ("gemma", 4, 2048, True),
              ("gemma", 8, 1024, True), ("gemma", 16, 512, True), ("d64", 3, 2000, True), ("d64", 4, 4096, True)]
    out = []
    for model, batch, seq, causal in shapes:
        hq, hkv, d = heads[model]
        problem = FlashProblem("fwd", batch, hq, hkv, seq, seq, d, causal)
        default = dict(FAMILY.default_config(problem, device))
        if default["LOADS"] != GLUON_WS:
            continue
        label = f"{model} {batch}x{seq}{' causal' if causal else ''} ({default['BLOCK_N']}-key blocks)"
        variants = {"static": (Config(dict(default, TILE_QUEUE=False)), None),
                    "queue": (Config(dict(default, TILE_QUEUE=True)), None)}
        if d == 256 and default["BLOCK_N"] == 64:  # head dim 256's short calls: one split slot of 128 keys too
            split = dict(default, BLOCK_N=128, num_stages=1)
            variants.update({"split static": (Config(dict(split, TILE_QUEUE=False)), None),
                             "split queue": (Config(dict(split, TILE_QUEUE=True)), None)})
        out.append((label, problem, variants))
    return out


def _rendered(pr: FlashProblem, config: Config, patch: str | None):
    """The family's forward module for `config`, with the source patches applied."""
    module = FAMILY.kernel_module(pr, config, interpret=False, store_lse=False)
    return _patched(module, patch) if patch else module


def _patched(module, patch: str):
    source = Path(module.__file__).read_text()
    for part in patch.split("+"):
        if len(PATCHES[part]) == 3:
            first, after, new = PATCHES[part]
            if source.count(first) != 1 or after not in source[source.find(first):]:
                raise SystemExit(f"patch {part!r} no longer matches the rendered kernel: update this script")
            start = source.index(first)
            old = source[start:source.index(after, start)]
        else:
            old, new = PATCHES[part]
        if source.count(old) != 1:
            raise SystemExit(f"patch {part!r} no longer matches the rendered kernel: update this script")
        source = source.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"gluon_variant_{patch.replace('+', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)
    return patched


def inputs_and_cudnn(pr: FlashProblem) -> tuple:
    """(q, k, v, cudnn): random bf16 (B, H, S, D) inputs of `pr` on the GPU, and a call of SDPA's cuDNN backend on
    them (K and V repeated to the query heads)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(pr.batch, pr.heads_q, pr.seq_q, pr.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(pr.batch, pr.heads_kv, pr.seq_k, pr.head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    kr, vr = (t.repeat_interleave(pr.heads_q // pr.heads_kv, 1) for t in (k, v))
    scale = default_scale(pr.head_dim)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=pr.causal, scale=scale)
    return q, k, v, cudnn


def main() -> None:
    from triton.testing import do_bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated parts of shape labels to run (default: all)")
    parser.add_argument("--set", choices=("variants", "queue"), default="variants",
                        help="queue: each model shape's default with the tile queue on and off")
    args = parser.parse_args()
    wanted = [part for part in args.only.split(",") if part]
    for label, problem, variants in (queue_cases(_device()) if args.set == "queue" else cases()):
        if wanted and not any(part in label for part in wanted):
            continue
        pr = problem
        q, k, v, cudnn = inputs_and_cudnn(pr)
        scale = default_scale(pr.head_dim)
        want = cudnn()
        fns = {"cudnn": cudnn}
        default = FAMILY.default_config(pr, _device())
        if all(patch or config.to_json() != default.to_json() for config, patch in variants.values()):
            variants = {"default " + default.to_json(): (default, None), **variants}
        for name, (config, patch) in variants.items():
            if FAMILY.space(pr, _device()).admit(config) is None:
                print(f"  {label}: {name} is outside the space, skipped")
                continue
            module = _rendered(pr, config, patch)
            o = torch.empty_like(q)
            lse = torch.empty(pr.batch, pr.heads_q, pr.seq_q, device="cuda", dtype=torch.float32)
            plan = forward_plan(module, pr, config, scale, q, k, v, o, lse, None, False, keep=True)

            def run(plan=plan, o=o, lse=lse):
                plan(q, k, v, o, lse, lse, lse, lse, lse)
                return o

            err = (run().float() - want.float()).abs().max().item()
            if not err < 3e-2:
                print(f"  {label}: {name} differs from cuDNN by {err:.3g}, not timed")
                continue
            fns[name] = run
        pairs = pr.seq_q * pr.seq_k - (pr.seq_q * (pr.seq_q - 1) // 2 if pr.causal else 0)
        flops = 4 * pr.batch * pr.heads_q * pairs * pr.head_dim
        times = {n: [] for n in fns}
        for _ in range(args.rounds):
            for n, f in fns.items():
                times[n].append(do_bench(f, warmup=10, rep=40, return_mode="median"))
        best = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        print(f"{label}: " + ", ".join(f"{n} {flops / ms / 1e9:.0f} ({best['cudnn'] / ms:.2f}x)"
                                       for n, ms in best.items()), flush=True)


def _device():
    from autotile.device import cuda_device

    return cuda_device()


if __name__ == "__main__":
    main()
