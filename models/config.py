"""ModelConfig: the frozen description of a Transformer (sizes, layer pattern, dtypes, remat).

Layer pattern: the block of P = lcm(len(mixers), len(ffns)) layers (layer i uses
mixers[i % len(mixers)] and ffns[i % len(ffns)]) is repeated n_layers / P times.
Mixers with their own settings (NSA, MSA, ...) add a small nested frozen dataclass field here.
"""

from __future__ import annotations

import dataclasses
import math

DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = (None, "xla", "cudnn", "flash")
# jax.checkpoint_policies members that are policies themselves (not factories needing arguments).
REMAT_POLICIES = ("everything_saveable", "nothing_saveable", "dots_saveable", "checkpoint_dots",
                  "dots_with_no_batch_dims_saveable", "checkpoint_dots_with_no_batch_dims")


def padded_vocab_size(tokenizer_size: int, multiple: int = 128) -> int:
    """The tokenizer's vocabulary size rounded up to a multiple of `multiple`."""
    if tokenizer_size <= 0:
        raise ValueError(f"tokenizer_size must be positive, got {tokenizer_size}")
    return -(-tokenizer_size // multiple) * multiple


def remat_choices() -> tuple[str, ...]:
    import jax
    available = tuple(p for p in REMAT_POLICIES if hasattr(jax.checkpoint_policies, p))
    return ("none", "full") + available


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    """Native Sparse Attention (arXiv 2502.11089) settings, used by layers whose mixer is "nsa".

    Sizes: compression blocks of length cmp_block_len (l) with stride cmp_stride (d); selection
    blocks of length sel_block_size (l'), n_selected (n) of them per query and KV group, the n_init
    initial and n_local local blocks always among them; a sliding window of `window` (w) keys.
    """

    cmp_block_len: int = 32
    cmp_stride: int = 16
    sel_block_size: int = 64
    n_selected: int = 16
    n_init: int = 1
    n_local: int = 2
    window: int = 512
    separate_kv: bool = True  # separate K/V projections per branch (the paper's recommendation)
    remap: str = "overlap"  # "overlap" | "eq9": compression -> selection score remap
    cmp_mlp_hidden: int | None = None  # hidden width of the compression MLP; None = head_dim
    # Initial biases of the per-head sigmoid gates (compressed, selected, window): the default
    # starts the window branch at sigmoid(1) = 0.73 and the two sparse branches at 0.27.
    gate_bias: tuple[float, ...] = (-1.0, -1.0, 1.0)
    # Query heads with a window branch: the first `window_heads` of them; None = every head. The
    # other heads' window gate is fixed at 0, so everything they read comes through compression
    # and selection (the n_init / n_local blocks still give them the start and the recent past).
    # A small model otherwise learns to retrieve inside the window only and never trains the far
    # route (eval/BENCHMARKS.md, issue 5). Their window attention is still computed (and counted
    # in flops_per_token): simpler than a per-head kernel call, and cheap next to the rest.
    window_heads: int | None = None
    # Kernel backend of all three branches: None (best available), "xla", "pallas_gpu",
    # "pallas_tpu".
    implementation: str | None = None

    def __post_init__(self):
        for name in ("cmp_block_len", "cmp_stride", "sel_block_size", "n_selected", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"NSAConfig.{name}={v!r}: must be a positive int")
        for name in ("n_init", "n_local"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"NSAConfig.{name}={v!r}: must be a non-negative int")
        if self.cmp_stride > self.cmp_block_len:
            raise ValueError(f"NSAConfig.cmp_stride={self.cmp_stride}: must be <= cmp_block_len="
                             f"{self.cmp_block_len} (blocks overlap or touch, never leave gaps)")
        if self.n_init + self.n_local > self.n_selected:
            raise ValueError(f"NSAConfig.n_selected={self.n_selected}: must be >= n_init + n_local "
                             f"= {self.n_init + self.n_local} (the always-selected blocks)")
        if self.remap not in ("overlap", "eq9"):
            raise ValueError(f"NSAConfig.remap={self.remap!r}: valid choices: 'overlap', 'eq9'")
        if self.remap == "eq9" and (self.cmp_block_len % self.cmp_stride
                                    or self.sel_block_size % self.cmp_stride):
            raise ValueError(f"NSAConfig.remap='eq9' needs cmp_stride={self.cmp_stride} to divide "
                             f"cmp_block_len={self.cmp_block_len} and sel_block_size="
                             f"{self.sel_block_size}; use remap='overlap' or change the sizes")
        wh = self.window_heads
        if wh is not None and (not isinstance(wh, int) or isinstance(wh, bool) or wh < 0):
            raise ValueError(f"NSAConfig.window_heads={wh!r}: must be an int >= 0 (the first "
                             "window_heads query heads keep the window branch) or None (all)")
        h = self.cmp_mlp_hidden
        if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h <= 0):
            raise ValueError(f"NSAConfig.cmp_mlp_hidden={h!r}: must be a positive int or None "
                             "(= head_dim)")
        if isinstance(self.gate_bias, list):
            object.__setattr__(self, "gate_bias", tuple(self.gate_bias))
        gb = self.gate_bias
        if (not isinstance(gb, tuple) or len(gb) != 3 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                for x in gb)):
            raise ValueError(f"NSAConfig.gate_bias={gb!r}: must be 3 finite numbers (compressed, "
                             "selected, window gate biases)")
        if self.implementation not in (None, "xla", "pallas_gpu", "pallas_tpu"):
            raise ValueError(f"NSAConfig.implementation={self.implementation!r}: valid choices: "
                             "None (best available), 'xla', 'pallas_gpu', 'pallas_tpu'")


@dataclasses.dataclass(frozen=True)
class AttnResConfig:
    """Attention Residuals (arXiv 2603.15031) settings, used when residual is "attnres_*"."""

    n_blocks: int = 8  # Block AttnRes: layers are grouped into this many blocks
    implementation: str | None = None  # depth-attention kernel: None | "xla" | "pallas_gpu" | "pallas_tpu"

    def __post_init__(self):
        if not isinstance(self.n_blocks, int) or isinstance(self.n_blocks, bool) or self.n_blocks <= 0:
            raise ValueError(f"AttnResConfig.n_blocks={self.n_blocks!r}: must be a positive int "
                             "dividing 2 * n_layers (each mixer and each FFN is one AttnRes layer)")
        choices = (None, "xla", "pallas_gpu", "pallas_tpu")
        if self.implementation not in choices:
            raise ValueError(f"AttnResConfig.implementation={self.implementation!r}: valid "
                             f"choices: {choices}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 0  # 0 = the tokenizer's size rounded up to 128 (filled in by the trainer)
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int | None = None  # None = d_model // n_heads
    d_ff: int | None = None  # None = 8/3 * d_model rounded up to a multiple of 64 (SwiGLU)
    mixers: tuple[str, ...] = ("dense",)
    ffns: tuple[str, ...] = ("swiglu",)
    residual: str = "standard"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    remat: str = "none"  # "none" | "full" | a jax.checkpoint_policies name, e.g. "dots_saveable"
    scan_layers: bool = True
    init_std: float = 0.02
    max_seq_len: int = 4096  # used only for checks and cache sizes
    nsa: NSAConfig = NSAConfig()
    attnres: AttnResConfig = AttnResConfig()
    # Dense attention backend of jax.nn.dot_product_attention: None = cuDNN on a GPU for bfloat16 /
    # float16 compute when the shapes allow it (falling back to XLA with a logged warning if cuDNN
    # cannot trace), XLA otherwise; "xla" or "cudnn" force one ("cudnn" raises where unavailable).
    attention_impl: str | None = None
    # Width W of a causal depthwise convolution (with a residual) on every mixer's input; 0 = off.
    # Gives attention the previous tokens directly, so induction / recall circuits form in one
    # layer (models/short_conv.py). fla's linear-attention layers and Canon layers use W = 4.
    short_conv: int = 0

    def __post_init__(self):
        # Lists from YAML / CLI overrides become tuples so the config stays hashable.
        for name in ("mixers", "ffns"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if isinstance(value, list):
                value = tuple(value)
            object.__setattr__(self, name, value)
        self._validate()

    def _fail(self, name: str, why: str) -> None:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: {why}")

    def _validate(self) -> None:
        from . import registry

        if not isinstance(self.vocab_size, int) or self.vocab_size < 0:
            self._fail("vocab_size", "must be a non-negative int (0 = fill in from the tokenizer "
                       "with ModelConfig.with_vocab(tokenizer_size))")
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self._fail(name, "must be a positive int")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                self._fail("n_heads", f"must divide d_model={self.d_model} when head_dim is None "
                           "(or set head_dim explicitly)")
        elif not isinstance(self.head_dim, int) or self.head_dim <= 0:
            self._fail("head_dim", "must be a positive int or None (= d_model // n_heads)")
        if self.resolved_head_dim % 2:
            self._fail("head_dim", f"resolved head_dim {self.resolved_head_dim} must be even "
                       "for RoPE")
        if self.n_heads % self.n_kv_heads:
            self._fail("n_kv_heads", f"must divide n_heads={self.n_heads} "
                       "(grouped-query attention)")
        if self.nsa.window_heads is not None and self.nsa.window_heads > self.n_heads:
            self._fail("nsa", f"NSAConfig.window_heads={self.nsa.window_heads} exceeds "
                       f"n_heads={self.n_heads}; use at most n_heads (None = every head)")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff <= 0):
            self._fail("d_ff", "must be a positive int or None (= 8/3 d_model rounded up to 64)")
        for name, kind in (("mixers", "mixer"), ("ffns", "ffn")):
            names = getattr(self, name)
            if not names or not all(isinstance(n, str) for n in names):
                self._fail(name, f"must be a non-empty tuple of names; registered: "
                           f"{registry.registered(kind)}")
            unknown = [n for n in names if n not in registry.registered(kind)]
            if unknown:
                self._fail(name, f"unknown {kind} name(s) {unknown}; registered: "
                           f"{registry.registered(kind)}")
        if self.residual not in registry.registered("residual"):
            self._fail("residual", f"unknown residual scheme; registered: "
                       f"{registry.registered('residual')}")
        if self.n_layers % self.block_size:
            self._fail("n_layers", f"must be a multiple of lcm(len(mixers), len(ffns)) = "
                       f"{self.block_size} (mixers={self.mixers}, ffns={self.ffns})")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                self._fail(name, "must be a positive number")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                self._fail(name, f"must be one of {DTYPES}")
        if self.remat not in remat_choices():
            self._fail("remat", f"must be one of {remat_choices()}")
        if self.attention_impl not in ATTENTION_IMPLS:
            self._fail("attention_impl", f"must be one of {ATTENTION_IMPLS}")
        if not isinstance(self.short_conv, int) or isinstance(self.short_conv, bool) \
                or self.short_conv < 0:
            self._fail("short_conv", "must be an int >= 0 (the kernel width; 0 = no convolution, "
                       "4 is the usual choice)")
        for name in ("tie_embeddings", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "must be True or False")

    # Derived sizes ---------------------------------------------------------------------------
    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def resolved_d_ff(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        return -(-(8 * self.d_model) // (3 * 64)) * 64

    @property
    def block_size(self) -> int:
        """P: layers in one repeated block, lcm(len(mixers), len(ffns))."""
        return math.lcm(len(self.mixers), len(self.ffns))

    @property
    def n_repeats(self) -> int:
        """How many times the block of P layers is repeated (the scan length)."""
        return self.n_layers // self.block_size

    def with_vocab(self, tokenizer_size: int, multiple: int = 128) -> "ModelConfig":
        """This config with vocab_size = tokenizer_size rounded up to `multiple` (if it was 0)."""
        if self.vocab_size:
            if self.vocab_size < tokenizer_size:
                raise ValueError(f"ModelConfig.vocab_size={self.vocab_size} is smaller than the "
                                 f"tokenizer's {tokenizer_size} tokens; raise it or set it to 0")
            return self
        return dataclasses.replace(self, vocab_size=padded_vocab_size(tokenizer_size, multiple))
