"""A tiny NSA model for `make train` (same size and data as configs/tiny.py, mixer "nsa").

4 layers, d_model 256, 4 query heads over 2 KV heads, on bytes with seq_len 256. NSA sizes fit
that length: compression blocks of 16 with stride 8 (31 compressed tokens at 256), 4 selected
blocks of 32 (the first, the two local ones and one chosen by score: half the context at 256), a
window of 64.
The dense model is one flag away: --set model.mixers=dense.
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models import ModelConfig, NSAConfig

NSA = NSAConfig(cmp_block_len=16, cmp_stride=8, sel_block_size=32, n_selected=4, n_init=1,
                n_local=2, window=64)

CONFIG = Config(
    model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("nsa",), nsa=NSA,
                      scan_unroll=0),
    data=DataConfig(sources=("embedded",), tokenizer="byte", seq_len=256, batch_size=16),
    optim=OptimConfig(lr=2e-3, warmup_steps=30, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=100, keep=3),
    eval=EvalConfig(every=100, batches=8, final_batches=32),
    run=RunConfig(name="nsa_tiny", steps=300, log_every=20),
)
