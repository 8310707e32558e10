"""Whether SDPA's cuDNN backward can run on a given O and LSE, without running its forward again (GPU).

flash_vendor.backward serves cuDNN's backward through autograd, so every call runs cuDNN's forward first (the note
in FlashFamily.timed_call: 2.01 ms against 1.54 ms alone at 2 x 32 x 4096 causal). This is why the runtime sends an
untuned backward of a generated forward to the Gluon backward (ops_flash.gluon_before_vendor), and why training
calls whose backward would still be SDPA's run SDPA's own pair (ops_flash.sdpa_training_pair). ATen's
_scaled_dot_product_cudnn_attention_backward takes the forward's outputs instead. This script checks, against the
autograd gradients, which way of passing them gives the right gradients, and times the direct call beside
autograd's backward alone and beside flash_vendor.backward:
  - 'as returned': the forward's own LSE, cumulative lengths and RNG state;
  - 'from log2': the LSE rebuilt from the family's log2 (B, H, Sq) LSE, as a generated forward leaves it;
  - the bias argument (the op's schema takes a Tensor, where the forward took none): None, or an empty tensor.

    PYTHONPATH=. python benchmarks/prototypes/cudnn_backward_direct.py
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

from autotile.families import flash_vendor  # noqa: E402

# (label, batch, heads_q, heads_kv, seq, head_dim, causal)
SHAPES = (("MHA 1 x 8 x 1024 causal", 1, 8, 8, 1024, 128, True),
          ("GQA 2 x 32/8 x 2048 causal", 2, 32, 8, 2048, 128, True),
          ("MHA 2 x 16 x 1000 not causal", 2, 16, 16, 1000, 128, False),
          ("Gemma-2-9B 1 x 16/8 x 2048, head dim 256, causal", 1, 16, 8, 2048, 256, True))


def _forward(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)


def _direct(do, q, k, v, out, lse, fwd, bias, causal, scale):
    _, _, cum_q, cum_k, max_q, max_k, seed, offset, _ = fwd
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


def _relative_error(got, want) -> float:
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max()).item() for g, w in zip(got, want))


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    import triton.testing

    print(f"# cuDNN backward on a given O and LSE, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, batch, hq, hkv, seq, d, causal in SHAPES:
        scale = d ** -0.5
        q = torch.randn(batch, hq, seq, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
        k, v = (torch.randn(batch, hkv, seq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                .requires_grad_(True) for _ in range(2))
        do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        try:
            fwd = _forward(q, k, v, causal, scale)
        except RuntimeError as exc:
            print(f"{label}: cuDNN's forward refused it: {str(exc)[:200]}")
            continue
        out, lse = fwd[0], fwd[1]
        want = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        # The family's LSE: (B, H, Sq) fp32, log2 units; rebuilt in cuDNN's shape and strides.
        log2 = flash_vendor._log2_lse_from(lse, seq).contiguous()
        rebuilt = torch.empty_strided(lse.shape, lse.stride(), dtype=lse.dtype, device=lse.device)
        rebuilt.copy_((log2 * math.log(2.0)).reshape(lse.shape))
        print(f"{label}: cuDNN's LSE {tuple(lse.shape)} strides {lse.stride()} {lse.dtype}; max |rebuilt - LSE| "
              f"{(rebuilt - lse).abs().max().item():.2e}")
        timed = {"autograd, backward alone": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                 "flash_vendor.backward (forward again)": lambda: flash_vendor.backward(
                     flash_vendor.CUDNN, do, q, k, v, out.detach(), log2, causal=causal, scale=scale)}
        qd, kd, vd, od = (t.detach() for t in (q, k, v, out))
        for lse_name, given in (("as returned", lse), ("from log2", rebuilt)):
            for bias_name, bias in (("no bias", None), ("empty bias", torch.empty(0, device="cuda",
                                                                                   dtype=torch.bfloat16))):
                name = f"direct, LSE {lse_name}, {bias_name}"
                try:
                    got = _direct(do, qd, kd, vd, od, given, fwd, bias, causal, scale)
                except (RuntimeError, TypeError) as exc:
                    print(f"  {name}: refused: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                err = _relative_error(got, want)
                print(f"  {name}: max relative error {err:.4f}" + (" WRONG" if err > 2e-2 else ""))
                if err <= 2e-2:
                    timed[name] = (lambda g=given, b=bias: _direct(do, qd, kd, vd, od, g, fwd, b, causal, scale))
        for name, fn in timed.items():
            print(f"  {name}: {triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
