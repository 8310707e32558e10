"""The template variants of benchmarks/prototypes/gluon_stream_k_diag.py still find their anchors in today's Gluon
GEMM template, each changes it, and each renders to Python that parses: a template change that moves an anchor fails
here, not on the GPU."""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import jinja2
import pytest

from autotile.families.gemm import FAMILY, contiguous_problem
from autotile.resources import templates_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "prototypes"))

PROBLEM = contiguous_problem(576, 2560, 4096, "bf16", "bf16", layout_b="col")


def render(text: str, config) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    return env.from_string(text).render(**FAMILY.render_switches(PROBLEM, config))


@pytest.fixture(scope="module")
def variants():
    import gluon_stream_k_diag as diag

    source = (templates_dir() / diag.TEMPLATE).read_text()
    return source, diag.variants(source), diag.configs(PROBLEM)


def test_each_variant_changes_the_template(variants):
    source, changed, _ = variants
    changed = dict(changed)  # the fixture's, shared with the other tests
    assert changed.pop("orig") == source
    for name, text in changed.items():
        assert text != source, name


@pytest.mark.parametrize("schedule", ["sk", "split2"])
def test_each_variant_renders_to_python(variants, schedule):
    _, changed, configs = variants
    for name, text in changed.items():
        ast.parse(render(text, configs[schedule]))


def test_splitowned_alone_takes_the_owners_protocol(variants):
    _, changed, configs = variants
    assert "_arrive_owning(" in render(changed["splitowned"], configs["split2"])
    for name in ("orig", "nofix"):
        assert "_arrive_owning(" not in render(changed[name], configs["split2"]), name


def test_skfirst_runs_the_split_share_before_the_whole_tiles(variants):
    _, changed, configs = variants
    source = render(changed["skfirst"], configs["sk"])
    for partition, end in (("def _producer(", "def _operands("), ("def _consumer(", "def _consumer_wide(")):
        body = source[source.index(partition):]
        body = body[:body.index(end)] if end in body else body
        assert body.index("_sk_bounds(") < body.index("for tile in range(gl.program_id(0), dp_tiles"), partition


@pytest.mark.parametrize("width", [16, 32, 64, 128, 256])
def test_register_order_covers_each_warpgroups_slot_once(width):
    # The template's _register_order (gemm_space.COALESCED_PARTIALS), evaluated on numpy's integers: a warpgroup's
    # part of a partial tile must map one to one onto its own WG_ROWS x width elements, or the last contributor would
    # sum other data. Widths: the whole tiles' and the two-part tiles' parts (64 + 16, 128 + 32, ...).
    import types

    import numpy as np

    source = (templates_dir() / "gemm_gluon_ws.py.j2").read_text()
    body = source[source.index("def _register_order("):]
    body = body[:body.index("\n\n")]
    scope = dict(gl=types.SimpleNamespace(constexpr=int))
    exec(body, scope)
    offsets = scope["_register_order"](np.arange(64), np.arange(width), width)
    assert offsets.shape == (64, width)
    assert sorted(offsets.ravel().tolist()) == list(range(64 * width))
    # A warp's register pair (8 rows x 4 lanes x 2 columns of the wgmma accumulator) is 64 contiguous floats.
    pair = offsets[0:8, 0:8]
    assert sorted(pair.ravel().tolist()) == list(range(pair.min(), pair.min() + 64))


def test_storeown_and_nofix_leave_the_own_sum_protocol(variants):
    import gluon_stream_k_diag as diag

    _, changed, _ = variants
    assert diag.KEEPING_OWN not in changed["storeown"]
    assert "{% else %}\n            last = _arrive_keeping_own(" not in changed["nofix"]
    assert "if j == u // rest:" not in changed["storeown"]
    assert "mask=offsets + u < 0" in changed["nofix"], "nofix keeps the split tiles' MMA work live"


def test_selected_names_known_variants(variants):
    import gluon_stream_k_diag as diag

    _, changed, _ = variants
    assert diag.selected(changed, None) == list(changed)
    assert diag.selected(changed, ["rowmajor"]) == ["orig", "rowmajor"]
    with pytest.raises(SystemExit, match="pick from"):
        diag.selected(changed, ["coalesced"])


def test_each_shapes_configs_are_in_the_space():
    # The diag times configs built by hand: each must be one the family's space admits on the GPU it runs on, or the
    # GPU call finds out. Swapped ones only on shapes of few tokens; data-parallel always, as the yardstick.
    import gluon_stream_k_diag as diag

    from autotile.device import planned_device

    for m, n, k in diag.SHAPES + [(3000, 3584, 18944)]:  # (the long-K tail's shape, named on the command line)
        problem = contiguous_problem(m, n, k, "bf16", "bf16", layout_b="col")
        configs = diag.configs(problem)
        assert "dp" in diag.configs(problem, ["split2"])
        assert ("swsplit2" in configs) == (m <= diag.SWAPPED_MAX_M)
        space = FAMILY.space(problem, planned_device("h100"))
        for name, config in configs.items():
            assert space.admit(config) is not None, (m, n, k, name, space.violations(config))


def test_stream_k_checks_names_known_variants_and_schedules(variants):
    # benchmarks/stream_k_checks.sh runs the diag in a device call: a name it does not know fails there, not here.
    import re

    import gluon_stream_k_diag as diag

    _, changed, _ = variants
    script = (Path(__file__).resolve().parent.parent / "benchmarks" / "stream_k_checks.sh").read_text()
    names, schedules = re.search(r"gluon_stream_k_diag\.py \"\$out\" (\S+) \\\n\s*(\S+)", script).groups()
    assert set(names.split(",")) <= set(changed)
    assert set(schedules.split(",")) <= set(diag.SCHEDULES)


# Variants compiled for sm90 in a child process (compile_child): rendering and parsing do not catch a variant that
# Triton rejects (a split tile whose `last` was a plain False failed in LLVM's lowering), and a GPU call is too dear
# to find it. Split 4 ways, 128 x 128, on the shape the diag times.
COMPILED = ("nofix", "storeown", "rowmajor", "splitnoload", "splitnowait", "splitowned")


def _compiled_variants() -> list:
    import shutil
    import tempfile

    import gluon_stream_k_diag as diag

    from autotile.device import planned_device
    from autotile.xcompile import compile_config

    texts = diag.variants((templates_dir() / diag.TEMPLATE).read_text())
    problem = contiguous_problem(1024, 512, 3584, "bf16", "bf16", layout_b="col")
    config = diag.configs(problem)["split4"]
    results = []
    for name in COMPILED:
        folder = Path(tempfile.mkdtemp(prefix="diag_variant_")) / name
        shutil.copytree(templates_dir(), folder)
        (folder / diag.TEMPLATE).write_text(texts[name])
        diag.use_template(folder)
        kernel, = compile_config(FAMILY, problem, config, planned_device("h100"))
        results.append(dict(name=name, kernel=kernel.name, features=list(kernel.ptx_features)))
        shutil.rmtree(folder.parent, ignore_errors=True)
    return results


def test_variants_compile_for_sm90():
    from compile_child import run_compile_child

    results = run_compile_child(__file__)
    assert [r["name"] for r in results] == list(COMPILED)
    for result in results:
        assert result["kernel"] == "gemm_kernel" and "wgmma" in " ".join(result["features"]), result


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_compiled_variants()) + "\n")
