"""A CPU-sized long-context NSA preset: 4K-token rows with the paper's default NSA sizes.

d_model 256, 4 layers, 4 query heads over 2 KV heads (head_dim 64) on bytes, seq_len 4096, batch 2.
NSA: compression blocks l = 32 with stride d = 16 (255 compressed tokens at 4K), n = 16 selected
blocks of l' = 64 (1024 keys), a window of w = 512: each query reads about 1.8K of the 4K keys at
the end of a row, and the share shrinks as rows grow (max_seq_len 16384 leaves room for longer
evaluation prompts). Remat keeps activation memory of the long rows small (so the layer scan stays
looped: unrolled, remat saved almost no memory; models/transformer.py).
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models import ModelConfig, NSAConfig

CONFIG = Config(
    model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("nsa",),
                      nsa=NSAConfig(cmp_block_len=32, cmp_stride=16, sel_block_size=64,
                                    n_selected=16, window=512),
                      max_seq_len=16384, remat="full"),
    data=DataConfig(sources=("embedded",), tokenizer="byte", seq_len=4096, batch_size=2),
    optim=OptimConfig(lr=1e-3, warmup_steps=50, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=200, keep=2),
    eval=EvalConfig(every=200, batches=4, final_batches=8),
    run=RunConfig(name="nsa_long", steps=400, log_every=10),
)
