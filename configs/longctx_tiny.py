"""A small NSA model for the long-context tasks: about an hour on a 2-core CPU.

Status (2026-11-30, eval/BENCHMARKS.md, issue 5): this recipe does not learn retrieval either.
Stopped at step 1301 (NSA) and 1876 (dense), the teacher-forced answer NLL was still at chance on
every task, the copy warm-up included. The copy circuit has to form first, at short distance (0-200
bytes of filler between a string and its repeat already stop it forming in 200 steps); see "Next"
there.

A byte-level decoder (4 layers, d_model 128, 4 query heads over 2 KV heads, NSA mixer) trained at
512 tokens on a mixture of the synthetic tasks of ``aiinfra_jax.data.synthetic`` and a little of
the default corpus: the eight RULER NIAH variants, passkey, MQAR, variable tracking and the string
copy warm-up. max_seq_len 4096 leaves room to evaluate at 2x and 4x the training length (prompt +
answer).

What the recipe is built around (eval/BENCHMARKS.md, issue 5): the first attempt (d_model 256, 1024
tokens, 650 steps, ~3,600 task documents) learned the answer format but never copied a value:
teacher-forced answer loss stayed at chance (~2.3 nats per digit), and two 512-token pilots of
300-500 steps did the same. The missing piece is the induction head (find the earlier occurrence,
copy what followed it), which forms only after a long plateau when few tokens per document train it.
So: short documents (many per row), synthetic documents weight their answers (2.0) far above their
haystacks (0.1), MQAR recalls every key inline (num_queries=16: 15 teacher-forced recalls per
document), and the "copy" task puts a 32-character random string in every answer, the densest
induction signal (a 2-layer model learns bare copying, a string then its repeat, in ~75 steps; the
copy task, with its string inside instructions and filler, did not start within 300 steps alone).
A smaller model (d_model 128 instead of 256) buys 1.7x the steps per hour.

NSA sizes are scaled to the 512-token training length so that retrieval has to go through the
sparse branches: compression blocks of 16 with stride 8, 8 selected blocks of 32 (half the context
at 512, an eighth at 2048, the first and the two local blocks among them) and a window of 128. The
dense baseline is one flag away (--set model.mixers=dense --set run.name=longctx_tiny_dense).

    python train.py --config configs/longctx_tiny.py
    python -m aiinfra_jax.eval.longctx --checkpoint runs/longctx_tiny --tasks niah \
        --lengths 512,1k,2k --depths 11 --samples 2
"""

from aiinfra_jax.config import CheckpointConfig, Config, EvalConfig, OptimConfig, RunConfig
from aiinfra_jax.data.config import DataConfig
from aiinfra_jax.models.config import ModelConfig, NSAConfig

_SYN = ":context_weight=0.1,answer_weight=2.0"

NSA = NSAConfig(cmp_block_len=16, cmp_stride=8, sel_block_size=32, n_selected=8, n_init=1,
                n_local=2, window=128)

CONFIG = Config(
    model=ModelConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mixers=("nsa",), nsa=NSA,
                      max_seq_len=4096),
    data=DataConfig(
        sources=("embedded", "synthetic:niah" + _SYN, "synthetic:passkey" + _SYN,
                 "synthetic:mqar" + _SYN + ",num_queries=16",
                 "synthetic:variable_tracking" + _SYN, "synthetic:copy" + _SYN),
        weights=(0.05, 0.35, 0.05, 0.2, 0.05, 0.3),
        tokenizer="byte", seq_len=512, batch_size=8),
    optim=OptimConfig(lr=4e-3, warmup_steps=100, schedule="cosine", weight_decay=0.1),
    checkpoint=CheckpointConfig(every=500, keep=2),
    eval=EvalConfig(every=500, batches=4, final_batches=16, longctx_every=500,
                    longctx_tasks=("niah", "passkey", "mqar", "copy"),
                    longctx_depths=(0.0, 0.5, 1.0), longctx_samples=1),
    run=RunConfig(name="longctx_tiny", steps=3000, log_every=25),
)
