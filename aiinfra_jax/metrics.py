"""Training metrics: JSONL / TensorBoard writers, a terminal progress bar, peak FLOP/s, MFU.

- ``MetricsWriter``: one JSON line per ``write`` in ``<log_dir>/metrics.jsonl`` plus TensorBoard scalars
  (the training loop makes one in process 0 only: one set of logs per run, however many processes).
- ``ProgressBar``: a single carriage-return line on a TTY, periodic plain lines otherwise (CI logs).
- ``peak_flops_per_device``: dense peak FLOP/s of one accelerator from a table keyed by
  ``device.device_kind``, or a measured float32 matmul peak where the table has no value (CPU).
- ``mfu``: model FLOPs utilisation from forward FLOPs per token and throughput.

No tensor shapes here; "tokens" are sequence positions processed by the model (batch * seq).
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MetricsWriter",
    "ProgressBar",
    "mfu",
    "peak_flops_per_device",
    "PEAK_FLOPS_TABLE",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------------


def _to_float(name: str, value: Any) -> float:
    """A Python float from a Python/numpy/jax scalar; clear errors for anything else."""
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    try:
        arr = np.asarray(jax.device_get(value))
    except Exception as e:  # pragma: no cover - exotic objects
        raise TypeError(f"metric {name!r} is a {type(value).__name__}, not a number") from e
    if arr.shape != ():
        raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {arr.shape}")
    if arr.dtype.kind in "OSUM" or np.issubdtype(arr.dtype, np.complexfloating):
        raise TypeError(f"metric {name!r} must be a real number, got {value!r} ({arr.dtype})")
    try:
        return float(arr)  # also covers bfloat16 / float8 (ml_dtypes), which are not np.number
    except (TypeError, ValueError) as e:
        raise TypeError(f"metric {name!r} must be a real number, got {value!r} ({arr.dtype})") from e


class MetricsWriter:
    """Appends metrics to ``<log_dir>/metrics.jsonl`` and to TensorBoard event files in ``log_dir``.

    Each ``write(step, metrics)`` adds one line ``{"step": step, "time": <unix s>, <name>: <float>...}``
    (non-finite values are written as JSON ``NaN``/``Infinity``, which Python's json reads back).

    ``resume_step``: when a run resumes from the checkpoint of that step, lines with a larger step
    (logged after that checkpoint, and about to be logged again) are dropped from ``metrics.jsonl``
    and TensorBoard is told to purge its events after that step.
    """

    def __init__(
        self,
        log_dir: str | Path,
        *,
        jsonl: bool = True,
        tensorboard: bool = True,
        resume_step: int | None = None,
    ) -> None:
        if not (jsonl or tensorboard):
            raise ValueError("MetricsWriter needs jsonl=True or tensorboard=True (both are False)")
        if resume_step is not None and (not isinstance(resume_step, int) or resume_step < 0):
            raise ValueError(f"resume_step must be None or an int >= 0, got {resume_step!r}")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        self._jsonl: TextIO | None = None
        self._tb = None
        if jsonl:
            if resume_step is not None and self.jsonl_path.exists():
                self._truncate_after(resume_step)
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: it pulls in protobuf

            # tensorboardX warns at every NaN scalar; NaN is a value here (a metric of layers
            # that do not route is NaN by design, models/transformer.py `_per_layer`), and a NaN
            # loss already shows on the console, in metrics.jsonl and as the run's bad step.
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(logdir=str(self.log_dir), purge_step=purge, flush_secs=30)

    def _truncate_after(self, resume_step: int) -> None:
        kept, dropped = [], 0
        for line in self.jsonl_path.read_text(encoding="utf-8").splitlines():
            try:
                step = json.loads(line).get("step")
            except json.JSONDecodeError:
                step = None  # a torn last line from a crash: drop it
            if isinstance(step, int) and step <= resume_step:
                kept.append(line)
            else:
                dropped += 1
        if dropped:
            logger.info("dropping %d line(s) after step %d from %s (resumed run)", dropped, resume_step, self.jsonl_path)
            self.jsonl_path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one record; values may be Python, numpy or jax scalars (converted to floats)."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"step must be an int, got {step!r}")
        step = int(step)
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"metric names must be non-empty strings, got {name!r}")
            if name == "step":
                if _to_float(name, value) != step:
                    raise ValueError(f"metrics['step'] = {value!r} disagrees with step={step}")
                continue
            values[name] = _to_float(name, value)
        if self._jsonl is not None:
            record = {"step": step, "time": round(time.time(), 3), **values}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------------------------------


def _format_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _format_rate(tokens_per_sec: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(tokens_per_sec) >= scale:
            return f"{tokens_per_sec / scale:.1f}{unit} tok/s"
    return f"{tokens_per_sec:.0f} tok/s"


class ProgressBar:
    """Terminal progress: ``desc  step/total pct | loss | tok/s | MFU | eta``.

    On a TTY the line is redrawn in place with a carriage return; otherwise (CI logs, files) a plain
    line is printed at most every ``interval_s`` seconds, plus the final step. ETA is extrapolated
    from the steps seen by this bar (so it is right after a resume too).
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        *,
        stream: TextIO | None = None,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be an int >= 1 (number of steps), got {total!r}")
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s!r}")
        self.total = total
        self.desc = desc
        self.stream = stream if stream is not None else sys.stdout
        self.interval_s = interval_s
        self._clock = clock
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty()) if callable(isatty) else False
        self._first: tuple[int, float] | None = None  # (step, time) of the first update
        self._last_print = -math.inf
        self._width = 0
        self._drawn = False

    def format(self, step: int, *, loss: float | None = None, tokens_per_sec: float | None = None,
               mfu: float | None = None, **extra: float) -> str:
        """The status line for ``step`` (no carriage return or newline)."""
        now = self._clock()
        parts = [f"{self.desc} " if self.desc else "", f"{step}/{self.total} {100.0 * step / self.total:5.1f}%"]
        if loss is not None:
            parts.append(f" | loss {float(loss):.4f}")
        if tokens_per_sec is not None:
            parts.append(f" | {_format_rate(float(tokens_per_sec))}")
        if mfu is not None:
            parts.append(f" | MFU {100.0 * float(mfu):.1f}%")
        for name, value in extra.items():
            parts.append(f" | {name} {float(value):.4g}")
        eta = math.nan
        if self._first is not None and step > self._first[0]:
            per_step = (now - self._first[1]) / (step - self._first[0])
            eta = per_step * max(self.total - step, 0)
        parts.append(f" | eta {_format_duration(eta)}")
        return "".join(parts)

    def update(self, step: int, **metrics: float) -> None:
        """Shows ``step`` with the given metrics (loss=, tokens_per_sec=, mfu=, any other floats)."""
        now = self._clock()
        line = self.format(step, **metrics)
        if self._first is None:
            self._first = (step, now)
        if self.tty:
            pad = " " * max(self._width - len(line), 0)
            self.stream.write("\r" + line + pad)
            self._width = len(line)
            self._drawn = True
            self.stream.flush()
        elif now - self._last_print >= self.interval_s or step >= self.total:
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_print = now

    def close(self) -> None:
        """Ends the in-place line (TTY) so later output starts on a fresh line."""
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


# --------------------------------------------------------------------------------------------------
# Peak FLOP/s and MFU
# --------------------------------------------------------------------------------------------------

# Dense (no structured sparsity) peak FLOP/s per device from vendor datasheets, by dtype of the
# matmul inputs. "float32" on NVIDIA Ampere and newer is the TF32 tensor-core rate, because JAX's
# default matmul precision runs float32 matmuls as TF32 there; on TPU it is the bf16 rate, because
# the default precision runs float32 matmuls as one bf16 pass. Under precision="highest" the real
# float32 peak is far lower. Patterns are matched in order against device.device_kind, lowercased.
PEAK_FLOPS_TABLE: tuple[tuple[str, str, dict[str, float]], ...] = (
    # TPUs (per chip). device_kind: "TPU v4", "TPU v5 lite" (v5e), "TPU v5" / "TPU v5p", "TPU v6 lite".
    (r"tpu ?7x|ironwood", "TPU v7 (Ironwood)", {"bfloat16": 2307e12, "float32": 2307e12}),
    (r"tpu v6 ?lite|tpu v6e|trillium", "TPU v6e", {"bfloat16": 918e12, "float32": 918e12}),
    (r"tpu v5 ?lite|tpu v5e", "TPU v5e", {"bfloat16": 197e12, "float32": 197e12}),
    (r"tpu v5p?\b", "TPU v5p", {"bfloat16": 459e12, "float32": 459e12}),
    (r"tpu v4 ?lite|tpu v4i", "TPU v4i", {"bfloat16": 138e12, "float32": 138e12}),
    (r"tpu v4", "TPU v4", {"bfloat16": 275e12, "float32": 275e12}),
    (r"tpu v3", "TPU v3", {"bfloat16": 123e12, "float32": 123e12}),
    (r"tpu v2", "TPU v2", {"bfloat16": 45e12, "float32": 45e12}),
    # NVIDIA. device_kind: "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200", "NVIDIA A100-SXM4-80GB".
    (r"b200", "NVIDIA B200", {"bfloat16": 2250e12, "float16": 2250e12, "float32": 1100e12}),
    (r"h100.*pcie", "NVIDIA H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    (r"h100.*nvl", "NVIDIA H100 NVL", {"bfloat16": 835e12, "float16": 835e12, "float32": 418e12}),
    (r"h100|h200|h800", "NVIDIA H100/H200 SXM", {"bfloat16": 989e12, "float16": 989e12, "float32": 494.5e12}),
    (r"a100|a800", "NVIDIA A100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
    (r"l40s", "NVIDIA L40S", {"bfloat16": 362e12, "float16": 362e12, "float32": 183e12}),
    (r"\bl4\b", "NVIDIA L4", {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12}),
    (r"\ba10\b", "NVIDIA A10", {"bfloat16": 125e12, "float16": 125e12, "float32": 62.5e12}),
    (r"rtx 4090", "NVIDIA RTX 4090", {"bfloat16": 165e12, "float16": 165e12, "float32": 82.6e12}),
    (r"v100", "NVIDIA V100", {"float16": 125e12, "float32": 15.7e12}),
    (r"\bt4\b", "NVIDIA T4", {"float16": 65e12, "float32": 8.1e12}),
)

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
                  "fp32": "float32", "f32": "float32", "float": "float32"}
_KNOWN_DTYPES = ("bfloat16", "float16", "float32")

_MEASURED: dict[tuple, float] = {}
_MEASURE_LOCK = threading.Lock()


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError as e:
            raise ValueError(f"dtype {dtype!r} is not a dtype; use one of {_KNOWN_DTYPES}") from e
    if name not in _KNOWN_DTYPES:
        raise ValueError(f"dtype {dtype!r} has no peak-FLOPs entry; use one of {_KNOWN_DTYPES}")
    return name


def lookup_peak_flops(device_kind: str, dtype: Any = "bfloat16") -> tuple[float, str] | None:
    """The table's ``(peak FLOP/s, source)`` for ``device_kind`` and ``dtype``, or None if unknown."""
    name = _dtype_name(dtype)
    kind = device_kind.lower()
    for pattern, label, peaks in PEAK_FLOPS_TABLE:
        if re.search(pattern, kind):
            if name in peaks:
                return peaks[name], f"spec table: {label} {name} dense"
            return None
    return None


def _measure_matmul_peak(device: Any, *, size: int = 512, repeats: int = 5) -> float:
    """Best observed float32 matmul FLOP/s per device, running one matmul on every local device of
    ``device``'s platform at once (so simulated devices that share CPU cores each get their share)."""
    devices = [d for d in jax.local_devices() if d.platform == device.platform] or [device]
    n = len(devices)
    mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    keys = jax.random.split(jax.random.key(0), 2)
    a = jax.device_put(jax.random.normal(keys[0], (n, size, size), jnp.float32), sharding)
    b = jax.device_put(jax.random.normal(keys[1], (n, size, size), jnp.float32), sharding)
    matmul = jax.jit(lambda x, y: jnp.einsum("nij,njk->nik", x, y), out_shardings=sharding)
    matmul(a, b).block_until_ready()  # compile + warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best  # FLOPs of one device's matmul / time


def peak_flops_per_device(device: Any = None, dtype: Any = "bfloat16") -> tuple[float, str]:
    """Dense peak FLOP/s of one ``device`` (default ``jax.devices()[0]``) for matmuls in ``dtype``.

    Returns ``(flops_per_second, source)``. Known accelerators come from ``PEAK_FLOPS_TABLE``;
    anything else (the CPU, an unlisted accelerator or dtype) is measured once per process with a
    jitted float32 matmul, and ``source`` says "measured matmul" (a warning is logged for
    accelerators, whose MFU is then only indicative).
    """
    device = device if device is not None else jax.devices()[0]
    kind = str(getattr(device, "device_kind", ""))
    platform = str(getattr(device, "platform", ""))
    found = lookup_peak_flops(kind, dtype)
    if found is not None:
        return found
    if platform != "cpu":
        logger.warning(
            "no peak-FLOPs table entry for device_kind=%r dtype=%s; measuring a float32 matmul instead "
            "(add the datasheet value to aiinfra_jax.metrics.PEAK_FLOPS_TABLE)", kind, _dtype_name(dtype)
        )
    key = (platform, kind, len(jax.local_devices()))
    with _MEASURE_LOCK:
        if key not in _MEASURED:
            _MEASURED[key] = _measure_matmul_peak(device)
    return _MEASURED[key], f"measured matmul (float32, {kind or platform})"


def mfu(flops_per_token_fwd: float, tokens_per_sec: float, n_devices: int, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak.

    A training step costs about 3x the forward FLOPs: the forward pass, plus the backward pass,
    which computes gradients with respect to both activations and weights (two matmuls per forward
    matmul). Recomputation (rematerialisation) is deliberately not counted, as is usual for MFU::

        mfu = 3 * flops_per_token_fwd * tokens_per_sec / (n_devices * peak)
    """
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices!r}")
    if not peak > 0:
        raise ValueError(f"peak must be a positive FLOP/s, got {peak!r}")
    if flops_per_token_fwd < 0 or tokens_per_sec < 0:
        raise ValueError(
            f"flops_per_token_fwd and tokens_per_sec must be >= 0, got {flops_per_token_fwd!r}, {tokens_per_sec!r}"
        )
    return 3.0 * flops_per_token_fwd * tokens_per_sec / (n_devices * peak)
