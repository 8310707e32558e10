"""Whether cuDNN's direct backward and SDPA's own backward can share one process on the same q, k and v (GPU).

Torch caches cuDNN's attention backward graphs by q, k and v alone (shapes, strides, flags), and each graph keeps the
strides of the O, dO and LSE it was built with (aten/src/ATen/native/cudnn/MHA.cpp, MHAParams). flash_vendor's
direct call (_cudnn_backward, behind CUDNN_BACKWARD_ON_GIVEN_LSE) passes O in q's layout and dO as given, as SDPA's
own backward does. This script runs both on the same q, k and v and the same dO, in both orders, with dO laid out like
O and unlike it, each case on a sequence length of its own (a fresh graph key), and prints every gradient's relative
error against float64. Any case past 1e-2 means the two calls mixed one graph. A second table gives two calls on the
same q, k and v dO laid out differently (one like O, one not), every pairing of the two backwards, SDPA's own twice
included: where that pairing is wrong too, the exposure is torch's own, not the direct call's.

    PYTHONPATH=. python benchmarks/prototypes/cudnn_graph_cache_layouts.py
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import torch  # noqa: E402

from autotile.families import flash_vendor  # noqa: E402
from autotile.families.flash_reference import attention_grads  # noqa: E402

SCALE = 128 ** -0.5


def laid(shape, heads_major: bool, gen):
    """A (B, H, S, D) bf16 tensor, heads-major in memory or (B, S, H, D) transposed."""
    b, h, s, d = shape
    if heads_major:
        return torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16()
    return torch.randn(b, s, h, d, device="cuda", generator=gen).bfloat16().transpose(1, 2)


def sdpas_own(q, k, v, do):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = flash_vendor.forward(flash_vendor.CUDNN, *leaves, causal=True, scale=SCALE, need_lse=False)
    return torch.autograd.grad(out, leaves, do)


def direct(q, k, v, do):
    o, lse = flash_vendor.forward(flash_vendor.CUDNN, q, k, v, causal=True, scale=SCALE, need_lse=True)
    # O in q's layout, as SDPA's forward and the op's write it; dO the same tensor SDPA's own backward gets
    return flash_vendor.backward(flash_vendor.CUDNN, do, q, k, v, o, lse, causal=True, scale=SCALE)


def worst_error(got, want) -> float:
    return max(((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))


def main() -> int:
    flash_vendor.CUDNN_BACKWARD_ON_GIVEN_LSE = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    wrong = 0
    for case, (q_heads_major, do_like_o, direct_first) in enumerate(itertools.product((True, False), repeat=3)):
        seq = 128 + 64 * case  # a graph key of its own
        q, k, v = laid((2, 8, seq, 128), q_heads_major, gen), laid((2, 4, seq, 128), q_heads_major, gen), \
            laid((2, 4, seq, 128), q_heads_major, gen)
        # SDPA's O is in q's layout; dO like it, or the other layout (a .contiguous() somewhere downstream)
        do = laid((2, 8, seq, 128), q_heads_major if do_like_o else not q_heads_major, gen)
        want = attention_grads(*(t.double() for t in (q, k, v)), do.double(), causal=True, scale=SCALE,
                               dtype=torch.float64)
        order = (("direct", direct), ("SDPA's own", sdpas_own)) if direct_first else \
            (("SDPA's own", sdpas_own), ("direct", direct))
        cells = []
        for name, call in order:
            err = worst_error(call(q, k, v, do), want)
            wrong += err > 1e-2
            cells.append(f"{name} {err:.4f}{' WRONG' if err > 1e-2 else ''}")
        print(f"q {'heads-major' if q_heads_major else '(B, S, H, D)'}, dO {'like' if do_like_o else 'unlike'} O, "
              f"{'direct' if direct_first else 'SDPA'} first: " + ", ".join(cells), flush=True)
    calls = {"direct": direct, "SDPA's own": sdpas_own}
    for case, (first, second) in enumerate(itertools.product(calls, repeat=2)):
        seq = 1024 + 64 * case
        q, k, v = (laid((2, heads, seq, 128), False, gen) for heads in (8, 4, 4))
        cells = []
        for name, do_heads_major in ((first, False), (second, True)):
            do = laid((2, 8, seq, 128), do_heads_major, gen)
            want = attention_grads(*(t.double() for t in (q, k, v)), do.double(), causal=True, scale=SCALE,
                                   dtype=torch.float64)
            err = worst_error(calls[name](q, k, v, do), want)
            wrong += err > 1e-2
            cells.append(f"{name} (dO {'heads-major' if do_heads_major else 'like O'}) {err:.4f}"
                         f"{' WRONG' if err > 1e-2 else ''}")
        print("q (B, S, H, D), dO laid out otherwise the second time: " + ", then ".join(cells), flush=True)
    print(f"direct call refused: {not flash_vendor._cudnn_direct_ok.get(torch.device('cuda', 0), True)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
