"""The tiny DeaMoE model: configs/moe_tiny.py with every FFN a DeaMoE (models/deamoe.py).

Same size class as configs/tiny.py and configs/moe_tiny.py (4 layers, d_model 256, 4 query heads
over 2 KV heads, the byte tokenizer on the embedded corpus): 16 experts in 4 departments, top-4
softmax routing with at most 2 departments per token, department width 352 (= tiny's d_ff 704 /
department_limit 2), so at the limit the shared SwiGLU FLOPs per token equal the dense model's;
the 4 private 352 x 352 matrices per token add 2 * 4 * 352^2 FLOPs on top (about 0.9x the
shared part). Parameters per FFN: 4 departments x 3 x 256 x 352 shared + 16 x 352^2 private
(3.06M, against moe_tiny's 2.16M). Not yet matched to moe_tiny in parameters or active FLOPs:
the issue's quality comparison must pick that matching.
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models.config import ModelConfig
from aiinfra_jax.models.deamoe import DeaMoEConfig

CONFIG = Config(
    model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("dense",),
                      ffns=("deamoe",),
                      deamoe=DeaMoEConfig(num_experts=16, num_departments=4, top_k=4,
                                          department_limit=2, department_d_ff=352,
                                          private_placement="hidden", router="softmax",
                                          load_balance_weight=1e-2, z_loss_weight=1e-3)),
    data=DataConfig(sources=("embedded",), tokenizer="byte", seq_len=256, batch_size=16),
    optim=OptimConfig(lr=2e-3, warmup_steps=30, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=100, keep=3),
    eval=EvalConfig(every=100, batches=8, final_batches=32),
    run=RunConfig(name="deamoe_tiny", steps=300, log_every=20),
)
