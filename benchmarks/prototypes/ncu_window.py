"""The profiler window of the ncu drivers (ncu_gemm.py, ncu_flash_bwd.py), run with `ncu --profile-from-start off`."""
import torch

# Calls of each function before the window: compiles, autotuning of the vendor op and the caching allocator settle.
WARM_CALLS = 3


def profile_once(fns) -> None:
    """Each of `fns` run WARM_CALLS times, then once more each inside the profiler's range."""
    for _ in range(WARM_CALLS):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("done", flush=True)
