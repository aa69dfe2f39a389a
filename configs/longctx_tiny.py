"""A small dense model that learns the long-context tasks: about an hour on a 2-core CPU.

A byte-level decoder (4 layers, d_model 256, 4 query heads over 2 KV heads, dense attention; switch
model.mixers to ("nsa",) once NSA has landed) trained at 1024 tokens on a mixture of the default
corpus and the synthetic tasks of ``aiinfra_jax.data.synthetic``: the eight RULER NIAH variants,
passkey, MQAR and variable tracking. Synthetic documents weight their answers (2.0) far above their
haystacks (0.1), so the recall skill is what they teach; the corpus keeps the model a language
model. max_seq_len 8192 leaves room to evaluate at 2x and 4x the training length (prompt + answer):

    python train.py --config configs/longctx_tiny.py
    python -m aiinfra_jax.eval.longctx --checkpoint runs/longctx_tiny --tasks niah \
        --lengths 1k,2k,4k --depths 11 --samples 4
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models.config import ModelConfig

_SYN = ":context_weight=0.1,answer_weight=2.0"

CONFIG = Config(
    model=ModelConfig(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("dense",),
                      max_seq_len=8192),
    data=DataConfig(
        sources=("embedded", "synthetic:niah" + _SYN, "synthetic:passkey" + _SYN,
                 "synthetic:mqar" + _SYN, "synthetic:variable_tracking" + _SYN),
        weights=(0.3, 0.45, 0.05, 0.1, 0.1),
        tokenizer="byte", seq_len=1024, batch_size=8),
    optim=OptimConfig(lr=2e-3, warmup_steps=100, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=300, keep=2),
    eval=EvalConfig(every=300, batches=4, final_batches=16),
    run=RunConfig(name="longctx_tiny", steps=900, log_every=25),
)
