"""The default tiny model that `make train` trains on the embedded corpus (about 10 minutes on a 2-core CPU).

A dense decoder-only Transformer on bytes: 4 layers, d_model 256, 4 query heads over 2 KV heads.
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models.config import ModelConfig

CONFIG = Config(
    # scan_unroll=0: the 4 layers unrolled (same parameters), 1.2x faster steps on a CPU
    model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("dense",),
                      scan_unroll=0),
    data=DataConfig(sources=("embedded",), tokenizer="byte", seq_len=256, batch_size=16),
    optim=OptimConfig(lr=2e-3, warmup_steps=30, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=100, keep=3),
    eval=EvalConfig(every=100, batches=8, final_batches=32),
    run=RunConfig(name="tiny", steps=300, log_every=20),
)
