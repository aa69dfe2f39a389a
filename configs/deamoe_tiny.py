"""The tiny DeaMoE model: configs/moe_tiny.py with every FFN a DeaMoE (models/deamoe.py), matched
to moe_tiny in parameters and active FLOPs.

Same size class as configs/tiny.py and configs/moe_tiny.py (4 layers, d_model 256, 4 query heads
over 2 KV heads, the byte tokenizer on the embedded corpus). 32 experts in 8 departments of width
344, top-4 softmax routing within at most 2 departments per token; each expert's private part a
32 x 32 square on its department's first 32 channels. Per FFN:
  parameters   8 x 3 x 256 x 344 shared + 32 x 32^2 private = 2.146M  (moe_tiny: 8 x 3 x 256 x 352
               = 2.163M, -0.8%)
  active       2 departments x 3 x 256 x 344 + 4 x 32^2 = 532K weights per token (moe_tiny: 2
               experts x 3 x 256 x 352 = 541K, -1.5%), so the active FLOPs match too.
At matched parameters and active FLOPs a decode step at batch 1 loads about the same bytes as
moe_tiny (it touches its active weights): the byte saving the paper reports needs DeaMoE to
touch fewer weights than the MoE it replaces; eval/bench_moe.py --quality compares both settings
(`make bench-moe-quality`).
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models.config import ModelConfig
from aiinfra_jax.models.deamoe import DeaMoEConfig

CONFIG = Config(
    model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("dense",),
                      ffns=("deamoe",),
                      deamoe=DeaMoEConfig(num_experts=32, num_departments=8, top_k=4,
                                          department_limit=2, department_d_ff=344,
                                          private_dim=32, private_placement="hidden",
                                          router="softmax", load_balance_weight=1e-2,
                                          z_loss_weight=1e-3), scan_unroll=0),
    data=DataConfig(sources=("embedded",), tokenizer="byte", seq_len=256, batch_size=16),
    optim=OptimConfig(lr=2e-3, warmup_steps=30, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=100, keep=3),
    eval=EvalConfig(every=100, batches=8, final_batches=32),
    run=RunConfig(name="deamoe_tiny", steps=300, log_every=20),
)
