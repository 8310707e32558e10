"""`autotile export-kernel` for the elementwise and paged families: the written module runs without autotile.

Each test imports the written file with importlib and compares what it computes with an independent
torch result (eager torch for elementwise, the family's float32 reference for paged).
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from autotile.device import interpret_device
from autotile.errors import BadInputError
from autotile.expr import parse
from autotile.export_kernel import export_kernel, write_kernel
from autotile.families.elementwise import FAMILY as ELEMENTWISE
from autotile.families.paged import FAMILY as PAGED
from autotile.families.paged import PagedProblem
from autotile.space import Config
from test_export_kernel import load, run  # the CLI runner and the module loader both files use

CPU = interpret_device()
# A GPU profile, to export a kernel rendered for the compiler (without the interpreter's workarounds).
H200 = dataclasses.replace(CPU, profile="h200", name="NVIDIA H200", compute_capability=(9, 0), sm_count=132,
                           interpret=False)


def assert_standalone(source: str) -> None:
    assert not re.search(r"^\s*(import|from) autotile", source, re.M)


def written(tmp_path, family, problem, device=CPU, config=None, name="exported"):
    kernel = export_kernel(family, problem, device, config=config, db_url=f"sqlite:///{tmp_path / 'none.sqlite'}")
    assert_standalone(kernel.source)
    return load(write_kernel(kernel, tmp_path / f"{name}.py"), name)


# --- elementwise -------------------------------------------------------------------------

def silu_times_x_plus_y(x, y):
    return torch.nn.functional.silu(x.double()) * x.double() + y.double()


def test_elementwise_broadcast_row_vector(tmp_path):
    x, y = torch.randn(33, 37), torch.randn(37)  # 1221 elements: five 256-element blocks over four programs
    problem = ELEMENTWISE.problem_from_values(parse("silu(x)*x + y"), {"x": x, "y": y})
    assert (problem.layout, problem.rank, problem.strides) == ("strided", 2, "37,1;0,1")
    config = Config(BLOCK_SIZE=256, num_warps=2, num_stages=2, PERSISTENT=True, PROGRAMS_PER_SM=1, STREAMING=True)
    module = written(tmp_path, "elementwise", problem, config=config, name="exported_broadcast")
    assert module.CONFIG == dict(config)
    torch.testing.assert_close(module.fused(x=x, y=y).double(), silu_times_x_plus_y(x, y), rtol=1e-5, atol=1e-5)
    # The strides are the call's own: a transposed x, and full contiguous inputs (fewer collapsed dims), run too.
    xt = torch.randn(37, 33).t()
    torch.testing.assert_close(module.fused(x=xt, y=y).double(), silu_times_x_plus_y(xt, y), rtol=1e-5, atol=1e-5)
    full_y = torch.randn(33, 37)
    torch.testing.assert_close(module.fused(x=x, y=full_y).double(), silu_times_x_plus_y(x, full_y),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tuned for outputs of 1221 elements"):
        module.fused(x=x[:32], y=y)
    with pytest.raises(ValueError, match="y must be torch.float32"):
        module.fused(x=x, y=y.double())
    with pytest.raises(TypeError, match="missing \\['y'\\]"):
        module.fused(x=x)


def test_elementwise_contiguous_chain_with_scalar_outputs_a_tuple(tmp_path):
    expr = "a = exp(-x) * s; b = where(x > 0, a, x ** 3)"
    x = torch.randn(1000, dtype=torch.float64)
    problem = ELEMENTWISE.problem_from_values(parse(expr), {"x": x, "s": 0.5})
    assert problem.layout == "contiguous"
    module = written(tmp_path, "elementwise", problem, name="exported_tuple")
    a, b = module.fused(x=x, s=0.5)  # an fp64 scalar travels as its int64 bits
    want_a = torch.exp(-x) * 0.5
    torch.testing.assert_close(a, want_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b, torch.where(x > 0, want_a, x ** 3), rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="s must be a Python float"):
        module.fused(x=x, s=1)
    with pytest.raises(ValueError, match="rendered for contiguous inputs"):
        module.fused(x=torch.randn(2000, dtype=torch.float64)[::2], s=0.5)


def test_elementwise_cli_bf16_chain(tmp_path):
    out = tmp_path / "gelu_kernel.py"
    result = run("elementwise", "--expr", "gelu_tanh(x*1.7+0.3)", "--numel", 3000, "--dtype", "bf16",
                 "--gpu", "interpret", "--db", tmp_path / "none.sqlite", "--out", out)
    assert result.exit_code == 0, result.output
    assert "default config" in result.output and "call its fused(...)" in result.output
    source = out.read_text()
    assert_standalone(source)
    # Exported for the interpreter: bf16 outputs are rounded to nearest even by the kernel itself.
    assert "_fp32_to_bf16_rtne(t" in source
    module = load(out, "exported_gelu")
    x = torch.randn(3000).to(torch.bfloat16)
    problem = ELEMENTWISE.problem_for_expression("gelu_tanh(x*1.7+0.3)", "bf16", 3000)
    eager = torch.nn.functional.gelu(x.double() * 1.7 + 0.3, approximate="tanh").to(torch.bfloat16)
    result = ELEMENTWISE.check(problem, {"x": x}, {"out": module.fused(x=x)}, {"out": eager})
    assert result.ok, result.message


# --- paged -------------------------------------------------------------------------------

def check_paged(module, problem, seed=1, three_d=False):
    inputs = PAGED.make_inputs(problem, CPU, seed=seed)
    q = inputs["q"][:, 0] if three_d else inputs["q"]
    out = module.paged_attention(q, inputs["k_cache"], inputs["v_cache"], inputs["block_table"], inputs["context_lens"],
                                 scale=float(inputs["scale"]))
    assert out.shape == q.shape and out.dtype == q.dtype
    result = PAGED.check(problem, inputs, {"out": out.unsqueeze(1) if three_d else out},
                         PAGED.reference(problem, inputs))
    assert result.ok, result.message
    return inputs


def test_paged_split_variant_ragged_contexts(tmp_path):
    # GQA (2 query heads a KV head), two speculative queries, ragged contexts over shuffled pages, 3 partitions.
    problem = PagedProblem(batch=3, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, max_context=520,
                           mean_context=300, num_queries=2, dtype="bf16", kv_dtype="bf16")
    config = Config(VARIANT="split", BLOCK_N=64, PARTITION_SIZE=256, num_warps=2, num_stages=2)
    module = written(tmp_path, "paged", problem, config=config, name="exported_split")
    assert module._PARTITIONS == 3
    inputs = check_paged(module, problem)
    assert len(set(inputs["context_lens"].tolist())) > 1  # ragged
    longer = inputs["context_lens"].clone()
    longer[0] = 530
    with pytest.raises(ValueError, match="contexts of at most 520 tokens"):
        module.paged_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_table"], longer)
    with pytest.raises(ValueError, match="q must be \\(3, 2, 4, 32\\)"):
        module.paged_attention(inputs["q"].half(), inputs["k_cache"], inputs["v_cache"], inputs["block_table"],
                               inputs["context_lens"])


def test_paged_exported_with_softcap_and_window_computes_them(tmp_path):
    # Gemma-2's features baked into the written module: its kernel takes their values as PagedLaunch passes them.
    problem = PagedProblem(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, max_context=300,
                           mean_context=200, dtype="fp16", kv_dtype="fp16", softcap=5.0, window=40)
    config = Config(VARIANT="split", BLOCK_N=32, PARTITION_SIZE=256, num_warps=4, num_stages=3)
    module = written(tmp_path, "paged", problem, config=config, name="exported_features")
    assert module._FEATURES == (5.0 * 1.4426950408889634, 40)
    check_paged(module, problem)


def test_paged_cli_whole_variant_three_d_query(tmp_path):
    out = tmp_path / "paged_kernel.py"
    result = run("paged", "--batch", 3, "--context", 40, "--mean-context", 24, "--q-heads", 4, "--kv-heads", 1,
                 "--head-dim", 32, "--page-size", 8, "--dtype", "fp16", "--gpu", "interpret",
                 "--db", tmp_path / "none.sqlite", "--out", out)
    assert result.exit_code == 0, result.output
    assert "call its paged_attention(...)" in result.output
    assert_standalone(out.read_text())
    module = load(out, "exported_whole")
    assert module.CONFIG["VARIANT"] == "whole"
    problem = PagedProblem(batch=3, num_q_heads=4, num_kv_heads=1, head_dim=32, page_size=8, max_context=40,
                           mean_context=24, dtype="fp16", kv_dtype="fp16")
    check_paged(module, problem, three_d=True)


def test_paged_bf16_exported_for_a_gpu_refuses_the_interpreter(tmp_path):
    problem = PagedProblem(batch=2, num_q_heads=2, num_kv_heads=1, head_dim=32, page_size=16, max_context=32)
    module = written(tmp_path, "paged", problem, device=H200, name="exported_for_gpu")
    inputs = PAGED.make_inputs(problem, CPU)
    with pytest.raises(ValueError, match="export with --gpu interpret"):
        module.paged_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_table"],
                               inputs["context_lens"])


def test_paged_export_takes_padding_rows_as_the_op_does(tmp_path):
    """A context length of 0 pads a batch (the op returns zeros there); the exported launcher refused it."""
    problem = PagedProblem(batch=3, num_q_heads=2, num_kv_heads=1, head_dim=32, page_size=16, max_context=64,
                           mean_context=40, dtype="fp16", kv_dtype="fp16")
    module = written(tmp_path, "paged", problem, config=Config(VARIANT="whole", BLOCK_N=32, num_warps=4,
                                                               num_stages=2), name="exported_padding")
    inputs = PAGED.make_inputs(problem, CPU, seed=2)
    lens = inputs["context_lens"].clone()
    lens[1] = 0
    out = module.paged_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_table"], lens,
                                 scale=float(inputs["scale"]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    inputs["context_lens"] = lens
    want = PAGED.reference(problem, inputs)["out"]
    assert torch.allclose(out[[0, 2]].float(), want[[0, 2]].float(), atol=2e-3)
    with pytest.raises(ValueError, match="negative length"):
        module.paged_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["block_table"], lens - 1)


def test_gemm_export_checks_its_epilogue_tensors_and_where_it_may_run(tmp_path):
    """The gemm launcher checked only a and b: a (1, N) bias gave NaN, a short bias or residual was read out of
    bounds, misshapen fp8 scales gave a wrong result; and a bf16 kernel exported for a GPU returned numbers off by
    10^11 on CPU tensors (the interpreter's bf16 dots), where the paged launcher refuses."""
    from autotile.families.gemm import FAMILY as GEMM
    from autotile.families.gemm import contiguous_problem

    problem = contiguous_problem(5, 47, 70, "fp16", "fp16", bias=True, activation="gelu", residual=True)
    module = written(tmp_path, "gemm", problem, name="exported_epilogue")
    inputs = GEMM.make_inputs(problem, CPU, seed=4)
    a, b, bias, residual = (inputs[n] for n in ("a", "b", "bias", "residual"))
    for bad_bias, bad_residual, words in ((bias.reshape(1, 47), residual, "bias must be \\(47,\\)"),
                                          (bias[:10], residual, "bias must be \\(47,\\)"),
                                          (bias.float(), residual, "bias must be \\(47,\\) torch.float16"),
                                          (bias, residual[:1], "residual must be \\(5, 47\\)")):
        with pytest.raises(ValueError, match=words):
            module.matmul(a, b, bad_bias, residual=bad_residual)
    c = module.matmul(a, b, bias, residual=residual)
    assert GEMM.check(problem, inputs, {"c": c}, GEMM.reference(problem, inputs)).ok

    fp8 = contiguous_problem(16, 64, 64, "fp8", "bf16", scale_mode="row")
    module = written(tmp_path, "gemm", fp8, name="exported_fp8_rows")
    inputs = GEMM.make_inputs(fp8, CPU, seed=4)
    with pytest.raises(ValueError, match="scale_a must be float32 of shape \\(16, 1\\) or \\(16,\\)"):
        module.matmul(inputs["a"], inputs["b"], scale_a=inputs["scale_b"].reshape(1, -1)[:, :17],
                      scale_b=inputs["scale_a"].reshape(-1, 1))
    with pytest.raises(ValueError, match="scale_a must be float32"):
        module.matmul(inputs["a"], inputs["b"], scale_a=torch.tensor(1.0), scale_b=inputs["scale_b"])

    bf16 = contiguous_problem(33, 47, 70, "bf16", "bf16")
    module = written(tmp_path, "gemm", bf16, device=H200, name="exported_bf16_for_gpu")
    inputs = GEMM.make_inputs(bf16, CPU, seed=4)
    with pytest.raises(ValueError, match="export with --gpu interpret"):
        module.matmul(inputs["a"], inputs["b"])


def test_paged_balanced_and_prefill_configs_export_the_walk_they_run_and_say_so(tmp_path):
    """A balanced or prefill config exported with the 'whole' kernel's launcher while its header said balanced,
    with the balanced kernels in the file, never called."""
    problem = PagedProblem(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16, max_context=600,
                           mean_context=400, dtype="fp16", kv_dtype="fp16")
    balanced = Config(VARIANT="balanced", BLOCK_N=64, PARTITION_SIZE=256, BLOCK_M=16, num_warps=4, num_stages=3)
    kernel = export_kernel("paged", problem, CPU, config=balanced, db_url=f"sqlite:///{tmp_path / 'none.sqlite'}")
    assert kernel.config["VARIANT"] == "split" and "this module runs the split walk" in kernel.origin
    assert "def paged_attention_balanced" not in kernel.source and '"VARIANT":"balanced"' not in kernel.source
    check_paged(load(write_kernel(kernel, tmp_path / "exported_balanced.py"), "exported_balanced"), problem)
    # Speculative decoding's 8 tokens a sequence (2 x 8 query rows a program): a prefill config exports its walk.
    chunk = dataclasses.replace(problem, num_queries=8)
    prefill = Config(VARIANT="prefill", BLOCK_N=64, PARTITION_SIZE=256, BLOCK_M=16, num_warps=4, num_stages=3)
    kernel = export_kernel("paged", chunk, CPU, config=prefill, db_url=f"sqlite:///{tmp_path / 'none.sqlite'}")
    assert kernel.config["VARIANT"] == "whole" and "runs the whole walk" in kernel.origin
    check_paged(load(write_kernel(kernel, tmp_path / "exported_prefill.py"), "exported_prefill"), chunk)
    # A prompt's chunk of 40 tokens (80 rows a program): no decode walk holds it.
    with pytest.raises(BadInputError, match="decode programs hold G x Q = 80 query rows"):
        export_kernel("paged", dataclasses.replace(problem, num_queries=40), CPU,
                      db_url=f"sqlite:///{tmp_path / 'n.sqlite'}")
