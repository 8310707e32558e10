"""Dimensions of open LLMs, and the GEMM and attention problems one of them runs.

`autotile tune gemm --model llama3-8b --tokens 1,16,128,2048` tunes a model's projections at those token
counts (default: every M bucket, 1 to 8192); `--dims hidden=...,intermediate=...,heads=...,kv_heads=...`
describes a model that is not in the table. Weights are in nn.Linear layout (B = W.T, column-major);
each projection is listed both as serving engines fuse it (qkv, gate_up) and as Hugging Face models run
it (q, k, v, gate, up), since both reach the GEMM.

Sources: each model's config.json on the Hugging Face hub (hidden_size, intermediate_size,
num_attention_heads, num_key_value_heads, head_dim, attention bias).

>>> [(p.name, p.n, p.k) for p in projections(MODELS["llama3-8b"])][:3]
[('qkv', 6144, 4096), ('q', 4096, 4096), ('kv', 1024, 4096)]
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from autotile.errors import BadInputError

# The M buckets of the gemm family's serving ranges (powers of two, as vLLM's fused-MoE tables key M).
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class ModelDims:
    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv_bias: bool = False  # Qwen2 projects q, k and v with a bias
    softcap: float = 0.0  # attn_logit_softcapping: every layer's logits x -> softcap * tanh(x / softcap) (Gemma-2)
    sliding_window: int = 0  # tokens its local layers see (a query and the W - 1 before it); 0: none (Gemma-2, 3)

    def __post_init__(self):
        for field in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
                raise BadInputError(f"model {self.name}: {field} must be an integer from 1 to 2**20, got {value!r}")
        if not 0 <= self.sliding_window <= 1 << 24 or not 0 <= self.softcap < float("inf"):
            raise BadInputError(f"model {self.name}: sliding_window must be 0 (none) or a token count, and softcap "
                                f"a number >= 0 (0: none); got {self.sliding_window!r} and {self.softcap!r}")
        if self.heads % self.kv_heads:
            raise BadInputError(f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                                f"({self.kv_heads})")


MODELS: dict[str, ModelDims] = {m.name: m for m in (
    ModelDims("llama3-8b", 4096, 14336, 32, 8, 128),
    ModelDims("llama3-70b", 8192, 28672, 64, 8, 128),
    ModelDims("llama3.2-1b", 2048, 8192, 32, 8, 64),
    ModelDims("llama3.2-3b", 3072, 8192, 24, 8, 128),
    ModelDims("mistral-7b", 4096, 14336, 32, 8, 128),
    ModelDims("mistral-nemo-12b", 5120, 14336, 32, 8, 128),
    ModelDims("qwen2.5-7b", 3584, 18944, 28, 4, 128, qkv_bias=True),
    ModelDims("qwen2.5-14b", 5120, 13824, 40, 8, 128, qkv_bias=True),
    ModelDims("qwen2.5-72b", 8192, 29568, 64, 8, 128, qkv_bias=True),
    ModelDims("phi3-mini", 3072, 8192, 32, 32, 96),
    ModelDims("phi3-medium", 5120, 17920, 40, 10, 128),
    ModelDims("gemma2-9b", 3584, 14336, 16, 8, 256, softcap=50.0, sliding_window=4096),
    ModelDims("gemma2-27b", 4608, 36864, 32, 16, 128, softcap=50.0, sliding_window=4096),
    ModelDims("gemma2-2b", 2304, 9216, 8, 4, 256, softcap=50.0, sliding_window=4096),
    ModelDims("qwen2.5-1.5b", 1536, 8960, 12, 2, 128, qkv_bias=True),
    ModelDims("qwen2.5-3b", 2048, 11008, 16, 2, 128, qkv_bias=True),
    ModelDims("qwen2.5-32b", 5120, 27648, 40, 8, 128, qkv_bias=True),
    ModelDims("qwen3-4b", 2560, 9728, 32, 8, 128),
    ModelDims("qwen3-8b", 4096, 12288, 32, 8, 128),
    ModelDims("qwen3-14b", 5120, 17408, 40, 8, 128),
    ModelDims("phi4", 5120, 17920, 40, 10, 128),
    ModelDims("mistral-small-24b", 5120, 32768, 32, 8, 128),
    ModelDims("mistral-large-123b", 12288, 28672, 96, 8, 128),
    ModelDims("llama3.1-405b", 16384, 53248, 128, 8, 128),
    ModelDims("qwen2.5-0.5b", 896, 4864, 14, 2, 64, qkv_bias=True),
    ModelDims("qwen3-1.7b", 2048, 6144, 16, 8, 128),
    ModelDims("qwen3-32b", 5120, 25600, 64, 8, 128),
    ModelDims("phi4-mini", 3072, 8192, 24, 8, 128),
    ModelDims("gemma3-4b", 2560, 10240, 8, 4, 256, sliding_window=1024),
    ModelDims("gemma3-12b", 3840, 15360, 16, 8, 256, sliding_window=1024),
    ModelDims("gemma3-27b", 5376, 21504, 32, 16, 128, sliding_window=1024),
    ModelDims("llama2-7b", 4096, 11008, 32, 32, 128),
    ModelDims("llama2-13b", 5120, 13824, 40, 40, 128),
    ModelDims("gemma-2b", 2048, 16384, 8, 1, 256),
    ModelDims("gemma-7b", 3072, 24576, 16, 16, 256),
)}

_DIM_NAMES = {"hidden": "hidden", "intermediate": "intermediate", "ffn": "intermediate", "heads": "heads",
              "kv_heads": "kv_heads", "head_dim": "head_dim", "sliding_window": "sliding_window",
              "softcap": "softcap"}


@dataclass(frozen=True)
class Projection:
    name: str
    n: int  # out_features
    k: int  # in_features
    bias: bool = False


def model_dims(name: str | None = None, dims: str | None = None) -> ModelDims:
    """A model from the table, or one described by `dims` ("hidden=4096,intermediate=14336,heads=32,kv_heads=8").

    Names match without case and without '-', '_' or '.': "Llama3-8B" and "llama3_8b" are llama3-8b.
    """
    if dims:
        values = {}
        for part in dims.split(","):
            key, _, value = part.partition("=")
            key, value = key.strip().lower(), value.strip()
            number = value.replace(".", "", 1).isdigit() if key == "softcap" else value.isdigit()
            if key not in _DIM_NAMES or not number:
                raise BadInputError(f"--dims: {part.strip()!r} is not NAME=INTEGER (softcap=NUMBER) with NAME one of "
                                    f"{', '.join(sorted(set(_DIM_NAMES)))}")
            if _DIM_NAMES[key] in values:
                raise BadInputError(f"--dims gives {_DIM_NAMES[key]} twice; give each dimension once")
            values[_DIM_NAMES[key]] = float(value) if key == "softcap" else int(value)
        missing = {"hidden", "intermediate", "heads"} - set(values)
        if missing:
            raise BadInputError(f"--dims needs {', '.join(sorted(missing))} (kv_heads defaults to heads, head_dim "
                                "to hidden / heads)")
        values.setdefault("kv_heads", values["heads"])
        head_dim = values.get("head_dim", values["hidden"] // values["heads"] if values["heads"] else 0)
        model = ModelDims(name or "custom", **{**values, "head_dim": head_dim})  # the table's checks
        if "head_dim" not in values and values["hidden"] % values["heads"]:
            raise BadInputError(f"--dims: hidden={values['hidden']} is not a multiple of heads={values['heads']}; "
                                "give head_dim too")
        return model
    if not name:
        raise BadInputError("name a model (--model) or describe one (--dims hidden=...,intermediate=...,heads=...)")

    def squash(text: str) -> str:
        return "".join(ch for ch in text.lower() if ch.isalnum())

    for model in MODELS.values():
        if squash(model.name) == squash(name):
            return model
    raise BadInputError(f"unknown model {name!r}; known: {', '.join(MODELS)}; or describe it with "
                        "--dims hidden=...,intermediate=...,heads=...,kv_heads=...,head_dim=...")


def projections(model: ModelDims) -> list[Projection]:
    """The distinct (out_features, in_features) GEMMs of one decoder layer, fused and unfused."""
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    listed = [
        Projection("qkv", q + 2 * kv, model.hidden, model.qkv_bias),
        Projection("q", q, model.hidden, model.qkv_bias),
        Projection("kv", kv, model.hidden, model.qkv_bias),
        Projection("o", model.hidden, q),
        Projection("gate_up", 2 * model.intermediate, model.hidden),
        Projection("gate", model.intermediate, model.hidden),
        Projection("down", model.hidden, model.intermediate),
    ]
    seen, unique = set(), []
    for p in listed:
        if (p.n, p.k, p.bias) not in seen:
            seen.add((p.n, p.k, p.bias))
            unique.append(p)
    return unique


def parse_tokens(text: str | None) -> tuple[int, ...]:
    """--tokens "1,16,128,2048" -> (1, 16, 128, 2048); None -> every M bucket."""
    if text is None or not text.strip():
        return TOKEN_BUCKETS
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or not 1 <= int(part) <= 1 << 20:
            raise BadInputError(f"--tokens: {part!r} is not a token count from 1 to 2**20")
        values.append(int(part))
    return tuple(dict.fromkeys(values))


def gemm_problems(model: ModelDims, tokens: tuple[int, ...], dtype: str = "bf16") -> list:
    """One gemm problem per projection and token count, in nn.Linear layout."""
    from autotile.families.gemm import contiguous_problem

    return [contiguous_problem(m, p.n, p.k, dtype, dtype, layout_b="col", bias=p.bias)
            for p in projections(model) for m in tokens]


def flash_problems(model: ModelDims, tokens: tuple[int, ...], dtype: str = "bf16", batch: int = 1,
                   features: bool = True, shortest: int = 16) -> list:
    """Causal prefill attention of `batch` sequences of each token count, at the model's head configuration, with
    its soft-capping; a model with local layers also runs their window where a prompt is longer than it (shorter
    prompts are plain calls there: autotile.families.flash.effective_window). `features=False`: the head
    configuration alone (plain calls; what a policy against the vendor op, which has neither, is tuned on). Token
    counts below `shortest` are left out (tuning: calls that short are the vendor op's).

    >>> [(p.seq_q, p.window_left, p.softcap) for p in flash_problems(MODELS["gemma2-9b"], (2048, 8192))]
    [(2048, -1, 50.0), (8192, -1, 50.0), (8192, 4095, 50.0)]
    """
    from autotile.families.flash import FAMILY

    def problem(seq: int, window: int):
        return FAMILY.problem_type(direction="fwd", batch=batch, heads_q=model.heads, heads_kv=model.kv_heads,
                                   seq_q=seq, seq_k=seq, head_dim=model.head_dim, causal=True, dtype=dtype,
                                   window_left=window, softcap=model.softcap)

    if not features:
        model = replace(model, softcap=0.0, sliding_window=0)
    seqs = [s for s in tokens if s >= shortest]
    local = [problem(s, model.sliding_window - 1) for s in seqs if 0 < model.sliding_window < s]
    return [problem(s, -1) for s in seqs] + local


__all__ = ["MODELS", "TOKEN_BUCKETS", "ModelDims", "Projection", "model_dims", "projections", "parse_tokens",
           "gemm_problems", "flash_problems"]
