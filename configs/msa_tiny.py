"""A tiny MSA model (issue 21): routing over short documents, trained on this CPU in ~105 minutes.

A byte-level decoder (4 layers, d_model 128, 4 query heads over 2 KV heads of 32, a short
convolution of width 4 before every mixer), every mixer "msa" (models/attention/msa.py): routing
keys pooled per 2 tokens, the top 2 documents, layers 2 and 3 route, and keys and values NOT pooled
(kv_chunk=1: a query reads the chosen documents' own tokens; not MSA as published, whose pooled
chunks serve both, because this tiny model routes on chunk averages but does not learn to copy
out of them; eval/BENCHMARKS.md "MSA"). Rows of 256 tokens come from ``synthetic:msa_niah``
(aiinfra_jax/data/synthetic_msa.py): 4 documents of prose (27-55 tokens), then the query "{key} is
" and its 7-digit answer; 32 rows a step. Loss: the answer tokens (weight 1), a little LM on the
documents (0.05, to keep the document encoder a language model), and the routing InfoNCE of the
two routing layers (model.msa.routing_loss_weight).

Two data stages, after the long-context presets' lesson that copying must come first:
  steps 1-700     every document holds the needle fact (positives=4): whatever the routers pick,
                  the answer is in memory; the model learns to copy here (training loss 1.5 ->
                  0.5 around steps 450-550 under this schedule, 500-600 at 2000 steps; at 1200
                  steps it came at ~300, and a 400-step stage in 2000 ended before it), with the routing loss off
                  (optim.aux_weight=0: with in-batch negatives it would train from step 1 and
                  stop the copy, eval/BENCHMARKS.md "MSA");
  steps 701-2600  one needle among 4 documents, the others facts of other keys: one shares a word
                  with the needle's key (near_keys=1: "bold-river" beside "bold-stone", the near
                  misses a large bank is full of), two are as long as it (same_length=2: their
                  values sit at the needle value's positions, so position alone cannot tell them
                  apart, and a bank always holds many) (80%), plus the all-needle rows (20%); the
                  routing loss on (optim.loss_stages), each query scored against all 128 documents
                  of the batch (model.msa.routing_negatives="batch": in-batch negatives), and the
                  batch's two best-scoring other-row documents added to each query's memory
                  (model.stages: model.msa.memory_negatives=2 from step 701; from step 1 memory
                  negatives stop the copy from being learned).

Measured (eval/BENCHMARKS.md "MSA"), NIAH over banks of 32K / 128K / 1M tokens (about 785 /
3,130 / 24,960 documents), 400 queries on each of two collections (`eval.memory niah --seed` 7
and 8): exact match 98.2 and 99.5% / 97.5 and 97.0% / **95.0 and 95.8%** (1M over the 800:
95.4%, standard error 0.7 points); the needle's document in memory for 100% of queries at every
size. 2600 steps rather than 2000: the 2000-step schedule (about 75 minutes) scored 100% / 94% /
90% over 50 queries, and 600 steps more than 2600 (a continuation) fell to 88.5% at 1M. With
one memory negative instead of two (2000 steps, same seeds, 50 queries): 98% / 92% / 80%;
without the memory negatives stage: 90% / 78% / 74%; with near_keys=2 and no same_length
either: 68% / 62% / 54%. The second memory negative slows the steps after 700 (3.3-3.4k against
4.2-4.3k tokens/s before it): about 105 minutes alone.

    python train.py --config configs/msa_tiny.py
    python -m aiinfra_jax.eval.memory niah --checkpoint runs/msa_tiny --sizes 32k,128k,1m \
        --out-dir eval_runs/msa_niah
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models import ModelConfig
from aiinfra_jax.models.attention.msa import MSAConfig

MSA = MSAConfig(chunk=2, kv_chunk=1, top_k=2, max_documents=8, routing_negatives="batch",
                batch_query_tokens=32)
_ROWS = ("synthetic:msa_niah:docs=4,doc_weight=0.05,answer_weight=1.0,query_offset="
         f"{MSA.resolved_query_offset}")

CONFIG = Config(
    model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("msa",), msa=MSA,
                      short_conv=4, max_seq_len=4096,
                      stages=((700, {"msa.memory_negatives": 2}),), scan_unroll=0),
    data=DataConfig(sources=(_ROWS + ",positives=4", _ROWS + ",near_keys=1,same_length=2"),
                    weights=(1, 0),
                    stages=((700, (0.2, 0.8)),), tokenizer="byte", seq_len=256, batch_size=32),
    optim=OptimConfig(lr=3e-3, warmup_steps=50, schedule="cosine", weight_decay=0.1,
                      aux_weight=0.0, loss_stages=((700, 1.0, 1.0),)),
    checkpoint=CheckpointConfig(every=100, keep=3),
    eval=EvalConfig(every=600, batches=4, final_batches=16),
    run=RunConfig(name="msa_tiny", steps=2600, log_every=10),
)
