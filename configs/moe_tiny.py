"""The tiny mixture-of-experts model: configs/tiny.py with every FFN a dropless MoE.

Same size class as configs/tiny.py (4 layers, d_model 256, 4 query heads over 2 KV heads, the byte
tokenizer on the embedded corpus): 8 SwiGLU experts of width 352 (= tiny's d_ff 704 / top_k), top-2
softmax routing, so the active FFN FLOPs per token equal the dense model's (plus the router) while
the FFN holds 4x its parameters. Load-balancing loss 0.01 and router z-loss 0.001 (models/moe.py);
`--set model.moe.router=sigmoid` gives DeepSeek-V3 routing with the aux-loss-free bias.
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models.config import ModelConfig
from aiinfra_jax.models.moe import MoEConfig

CONFIG = Config(
    model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("dense",),
                      ffns=("moe",),
                      moe=MoEConfig(num_experts=8, top_k=2, expert_d_ff=352, router="softmax",
                                    load_balance_weight=1e-2, z_loss_weight=1e-3), scan_unroll=0),
    data=DataConfig(sources=("embedded",), tokenizer="byte", seq_len=256, batch_size=16),
    optim=OptimConfig(lr=2e-3, warmup_steps=30, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=100, keep=3),
    eval=EvalConfig(every=100, batches=8, final_batches=32),
    run=RunConfig(name="moe_tiny", steps=300, log_every=20),
)
