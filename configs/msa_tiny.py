"""A tiny MSA model (issue 21): routing over short documents, trained on this CPU in about 17 minutes.

A byte-level decoder (4 layers, d_model 128, 4 query heads over 2 KV heads of 32, a short
convolution of width 4 before every mixer), every mixer "msa" (models/attention/msa.py) with chunks
of 2 tokens and the top 2 documents; layers 2 and 3 route. Rows of 256 tokens come from
``synthetic:msa_niah`` (aiinfra_jax/data/synthetic_msa.py): 4 documents of prose (27-55 tokens),
then the query "{key} is " and its 7-digit answer; 32 rows a step. Loss: the answer tokens (weight
1), a little LM on the documents (0.05, to keep the document encoder a language model), and the
routing InfoNCE of the two routing layers (model.msa.routing_loss_weight).

Two data stages, after the long-context presets' lesson that copying must come first:
  steps 1-200    every document holds the needle fact (positives=4): whatever the routers pick,
                 the answer is in memory (these rows have no negatives: no routing loss);
  steps 201-600  one needle among 4 documents, the others facts of other keys (80%), plus the
                 all-needle rows (20%).

Status (2026-12-02, eval/BENCHMARKS.md "MSA"): the routers learn (in-row recall@1 rises within
200-300 steps; over a bank the needle is the first choice 48% / 22% / 10% of the time at 32K /
128K / 1M tokens in layer 2), but the model does not read answers back out of pooled memory: 0%
exact match, answer tokens at chance (22%, the EOS and frequent digits) with every recipe tried:
chunks of 16 (900-step rows of 16 documents), 8 (4 KV heads, a copy stage), 2 in 1024-token rows,
and this one. The paper's model (4B parameters, 64-token chunks) is far larger; what a tiny model
needs to copy out of chunk averages is open.

    python train.py --config configs/msa_tiny.py
    python -m aiinfra_jax.eval.memory niah --checkpoint runs/msa_tiny --sizes 32k,128k,1m \
        --out-dir eval_runs/msa_niah
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models import ModelConfig
from aiinfra_jax.models.attention.msa import MSAConfig

MSA = MSAConfig(chunk=2, top_k=2, max_documents=8)
_ROWS = ("synthetic:msa_niah:docs=4,doc_weight=0.05,answer_weight=1.0,query_offset="
         f"{MSA.resolved_query_offset}")

CONFIG = Config(
    model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("msa",), msa=MSA,
                      short_conv=4, max_seq_len=4096),
    data=DataConfig(sources=(_ROWS + ",positives=4", _ROWS), weights=(1, 0),
                    stages=((200, (0.2, 0.8)),), tokenizer="byte", seq_len=256, batch_size=32),
    optim=OptimConfig(lr=3e-3, warmup_steps=50, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=100, keep=3),
    eval=EvalConfig(every=300, batches=4, final_batches=16),
    run=RunConfig(name="msa_tiny", steps=600, log_every=10),
)
