"""The MSA memory bank from the command line, and needle-in-a-haystack over a bank (issue 21).

    python -m aiinfra_jax.eval.memory build --checkpoint RUN --docs PATH --out BANK
    python -m aiinfra_jax.eval.memory build --checkpoint RUN --docs MORE --out BANK --append
    python -m aiinfra_jax.eval.memory query --checkpoint RUN --bank BANK --prompt "golden-harbor is "
    python -m aiinfra_jax.eval.memory niah --checkpoint RUN --sizes 32k,128k,1m --out-dir DIR

build: encodes a local collection (a .jsonl file with a "text" field, a text file of blank-line
separated paragraphs, or a folder of .txt files; aiinfra_jax/memory_bank.read_documents) into a
bank (aiinfra_jax/memory_bank.py), with a progress bar. query: routes a prompt over the bank and
prints the greedy answer and the documents each routing layer chose. query and niah take
--kv-on-host: the bank's keys and values stay in their files and each query reads only its chosen
documents' (MemoryBank.to_device(kv_on_host=True)), for banks larger than the device's memory.

niah: the memory mode of the long-context evaluation. A bank of generated documents in the
distribution the model was trained on (the run's ``synthetic:msa_niah`` source: its haystack, its
document lengths), grown by appends to each size in turn; `queries` needle documents hold the fact
"{key} is {value}." and sit at random places among the first size's documents, every other
document holds a fact of another key while distinct keys last (10,302 adjective-noun pairs), the
rest are plain haystack. Each query is "[BOS]{key} is " (the training query's prompt); it is right
when the greedy answer up to EOS is the value. Per size: exact match, the answer tokens' NLL and
greedy accuracy given the true prefix (teacher forced), the share of queries whose needle
document is each routing layer's first choice (recall@1) and among its top-k, the share that some
routing layer brought into memory and exact match / token accuracy over those alone (the reading,
apart from the routing), the share whose needle is every routing layer's first choice and exact
match over those (the reading when the routing ranked right), how often a wrong first choice
holds a key that shares a word with the needle's (near_misses: the routing confusing "bold-river"
with "bold-stone") or is as long as the needle's (position taken for content), encoding
throughput (tokens/s of that append), prefill time of one query (routing over the whole bank) and
decode time per token (which the bank does not touch), bank bytes per memory token, and device
bytes of the bank. The JSON also holds each answer position's token accuracy (first digit ...
EOS; is it finding the value or copying it that fails?) and, per query, the needle's document, the
generated answer, each routing layer's choices and the teacher-forced hit of every answer token.
Results go to DIR/memory_niah.json and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aiinfra_jax import memory_bank as mb
from aiinfra_jax.data.synthetic_msa import (TRAIN_SEED_BASE, MSASource, fact_text, filler,
                                            query_prompt)
from aiinfra_jax.eval.longctx import format_length, parse_length
from aiinfra_jax.generate import decode_loop
from aiinfra_jax.load import load_model
from aiinfra_jax.tasks import haystack as hs
from aiinfra_jax.tasks.common import ADJECTIVES, NOUNS, distinct, example_rng, number7, word_keys

EVAL_SEED = 7  # never a training seed (those start at 2**40, data/synthetic_msa.py)


def _answer_text(tokenizer, tokens: np.ndarray, length: int) -> str:
    """The generated text up to EOS; ids the tokenizer does not have (the model's vocabulary is
    padded past it) show as <unk:ID> (never right, never dropped)."""
    ids = [int(t) for t in tokens[:length]]
    if ids and ids[-1] == tokenizer.eos_id:
        ids = ids[:-1]
    parts, run = [], []
    for t in ids + [None]:
        if t is not None and 0 <= t < tokenizer.vocab_size:
            run.append(t)
            continue
        if run:
            parts.append(tokenizer.decode(run))
            run = []
        if t is not None:
            parts.append(f"<unk:{t}>")
    return "".join(parts)


# The collection of the niah mode ---------------------------------------------------------------

def _msa_source(loaded) -> MSASource | None:
    for spec in loaded.config.data.sources:
        if spec.startswith("synthetic:msa_"):
            return MSASource(spec, loaded.config.data)
    return None


def niah_collection(loaded, sizes: list[int], queries: int, seed: int = EVAL_SEED
                    ) -> dict[str, Any]:
    """Documents up to max(sizes) tokens (module docstring): {"docs": token arrays, "prefix": the
    document count of each size, "needles": [(doc index, key, value)] (queries of them)}."""
    tok = loaded.tokenizer
    src = _msa_source(loaded)
    lo, hi = ((src.min_doc_length, src.max_doc_length) if src is not None else (32, 64))
    haystack = src.options.haystack if src is not None else "essay"
    rng = example_rng("msa_bank_niah", seed)
    lengths, total, prefix = [], 0, []
    for size in sorted(sizes):
        while total < size:
            n = int(rng.integers(lo, hi + 1))
            lengths.append(n)
            total += n
        prefix.append(len(lengths))
    if queries > prefix[0]:
        raise ValueError(f"niah: {queries} queries need as many documents in the smallest bank "
                         f"({prefix[0]} documents); lower --queries or raise the first size")
    n_keys = min(len(lengths), len(ADJECTIVES) * len(NOUNS))
    keys = word_keys(rng, n_keys)
    values = distinct(rng, n_keys, number7)
    needle_docs = rng.choice(prefix[0], size=queries, replace=False)
    key_of = {int(d): q for q, d in enumerate(needle_docs)}
    others = iter(range(queries, n_keys))
    docs, needles, doc_keys = [], [], []
    for j, n in enumerate(lengths):
        k = key_of[j] if j in key_of else next(others, None)
        doc_keys.append(None if k is None else keys[k])
        fact = (hs.encode(tok, fact_text(keys[k], values[k]) + " ") if k is not None
                else np.zeros(0, np.int32))
        if fact.size + 1 > n:
            n = fact.size + 1
        sentences = hs.sentence_source(tok, haystack, rng)
        docs.append(np.concatenate([[tok.bos_id], filler(n - 1, fact, sentences, rng)])
                    .astype(np.int32))
    for q, d in enumerate(needle_docs):
        needles.append((int(d), keys[q], values[q]))
    return {"docs": docs, "prefix": prefix, "needles": needles, "doc_keys": doc_keys}


def _shares_word(a: str | None, b: str) -> bool:
    """Whether key a ("adjective-noun", None for plain haystack) shares a word with key b."""
    return a is not None and a != b and bool(set(a.split("-")) & set(b.split("-")))


def _same_length(a: str | None, b: str) -> bool:
    """Whether key a (None for plain haystack) is another key of key b's length in characters:
    with the byte tokenizer its fact's value then sits at the needle value's positions."""
    return a is not None and a != b and len(a) == len(b)


def near_misses(choices: dict[Any, list[list[int]]], needles, doc_keys: list, n_docs: int
                ) -> dict[str, Any]:
    """Which wrong documents the routing prefers: per routing layer, the share of queries whose
    first choice is a wrong document whose key shares its adjective or its noun with the needle's
    key ("word_miss"), next to that share among the first choices that are wrong ("of_wrong") and
    the share of the bank's documents with such a key ("bank"; what a random wrong choice would
    give); the same for keys as long as the needle's ("length_miss", "length_of_wrong",
    "bank_same_length": position, not content, eval/BENCHMARKS.md "MSA"). choices[layer][q] =
    that layer's chosen documents for query q, best first."""
    def bank_share(match):
        return float(np.mean([sum(match(doc_keys[j], key) for j in range(n_docs)) / n_docs
                              for _, key, _ in needles]))

    out = {"bank": bank_share(_shares_word), "bank_same_length": bank_share(_same_length)}
    for layer, per_query in choices.items():
        wrong = shared = same = 0
        for (doc, key, _), chosen in zip(needles, per_query):
            first = int(chosen[0])
            if first >= 0 and first != doc:
                wrong += 1
                shared += _shares_word(doc_keys[first], key)
                same += _same_length(doc_keys[first], key)
        out[str(layer)] = {"word_miss": shared / len(needles),
                           "of_wrong": shared / wrong if wrong else None,
                           "length_miss": same / len(needles),
                           "length_of_wrong": same / wrong if wrong else None}
    return out


def _time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _teacher_forced(model, tokenizer, device_bank, prompts, needles, batch, mesh
                    ) -> tuple[np.ndarray, list[np.ndarray]]:
    """(summed NLL [queries] of each query's answer tokens and EOS, each given the true prefix,
    with the answer unread by the router (routing on the prompt alone, as in training); per
    query, the greedy hit [tokens] bool of each of those tokens). They move as soon as the model
    starts to copy; exact match waits for whole answers."""
    nll, by_token = [], []
    for first in range(0, len(prompts), batch):
        rows = []
        for prompt, (_, _, value) in zip(prompts[first:first + batch],
                                         needles[first:first + batch]):
            answer = hs.encode(tokenizer, value).tolist()
            rows.append((prompt, answer + [tokenizer.eos_id]))
        width = max(len(p) + len(a) - 1 for p, a in rows)
        tokens = np.zeros((len(rows), width), np.int32)
        lengths = np.zeros(len(rows), np.int32)
        unread = np.zeros(len(rows), np.int32)
        for b, (p, a) in enumerate(rows):
            seq = p + a[:-1]  # inputs: the prompt and the answer; targets: the answer and EOS
            tokens[b, :len(seq)], lengths[b], unread[b] = seq, len(seq), len(a) - 1
        logits, _ = mb.bank_prefill(model, device_bank, tokens, lengths, width, mesh,
                                    unread=unread, every_position=True)
        logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
        for b, (p, a) in enumerate(rows):
            at = np.arange(len(p) - 1, len(p) - 1 + len(a))
            nll.append(-float(logp[b, at, a].sum()))
            by_token.append(logp[b, at].argmax(-1) == np.asarray(a))
    return np.asarray(nll, np.float64), by_token


def _accuracy_by_position(hits: list[np.ndarray]) -> list[float]:
    """Mean greedy hit at each answer position (the EOS last) over the queries long enough."""
    width = max((h.size for h in hits), default=0)
    return [float(np.mean([h[i] for h in hits if h.size > i])) for i in range(width)]


def evaluate_size(model, tokenizer, bank: mb.MemoryBank, needles, *, batch: int,
                  max_new_tokens: int, mesh=None, doc_keys: list | None = None,
                  kv_on_host: bool = False) -> dict[str, Any]:
    """Exact match, routing recall and timings of the bank as it is (module docstring); mesh:
    the model's (the bank's chunks are scored split over its devices); doc_keys: the key of every
    collection document (None = no fact), for near_misses; kv_on_host: MemoryBank.to_device's."""
    device_bank = bank.to_device(mesh, kv_on_host=kv_on_host)
    prompts = [[tokenizer.bos_id] + hs.encode(tokenizer, query_prompt(key)).tolist()
               for _, key, _ in needles]
    right, found, first_choice = np.zeros(len(needles), bool), {}, {}
    in_memory = np.zeros(len(needles), bool)  # the needle among some routing layer's choices
    choices: dict[Any, list] = {}
    answers: list[str] = []
    for first in range(0, len(prompts), batch):
        part = needles[first:first + batch]
        ans = mb.generate_from_bank(model, device_bank, prompts[first:first + batch],
                                    max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_id,
                                    mesh=mesh, vocab=tokenizer.vocab_size)
        toks, lens = np.asarray(ans.result.tokens), np.asarray(ans.result.lengths)
        for b, (doc, _, value) in enumerate(part):
            answers.append(_answer_text(tokenizer, toks[b], lens[b]))
            right[first + b] = answers[-1] == value
            in_memory[first + b] = any(doc in c[b] for c in ans.documents.values())
            for layer, chosen in ans.documents.items():
                choices.setdefault(layer, []).append(list(chosen[b]))
                found[layer] = found.get(layer, 0) + int(doc in chosen[b])
                first_choice[layer] = first_choice.get(layer, 0) + int(doc == chosen[b][0])
    forced_nll, forced_hits = _teacher_forced(model, tokenizer, device_bank, prompts, needles,
                                              batch, mesh)
    hits, count = sum(int(h.sum()) for h in forced_hits), sum(h.size for h in forced_hits)
    in_mem_hits = [h for h, m in zip(forced_hits, in_memory) if m]
    mem_hits, mem_count = sum(int(h.sum()) for h in in_mem_hits), sum(h.size for h in in_mem_hits)
    per_query = [{"doc": int(doc), "key": key, "value": value, "answer": answers[i],
                  "exact": bool(right[i]), "in_memory": bool(in_memory[i]),
                  "choices": {str(layer): [int(d) for d in c[i]] for layer, c in choices.items()},
                  "forced_hits": forced_hits[i].astype(int).tolist()}
                 for i, (doc, key, value) in enumerate(needles)]
    ranked = np.asarray([all(c[i][0] == doc for c in choices.values())
                         for i, (doc, _, _) in enumerate(needles)], bool)
    # One query: the prefill (routing over every chunk) and the decode steps, timed apart.
    one = np.asarray([prompts[0]], np.int32)
    length = np.asarray([one.shape[1]], np.int32)
    logits, cache = mb.bank_prefill(model, device_bank, one, length, one.shape[1] + 16, mesh)
    prefill_s = _time(lambda: mb.bank_prefill(model, device_bank, one, length,
                                              one.shape[1] + 16, mesh)[0])
    graphdef, state = nnx.split(model)
    pos = jnp.asarray(length + model.cfg.msa.resolved_query_offset)

    def decode():  # decode_loop does not donate the cache: each repeat starts from the same one
        return decode_loop(graphdef, state, cache, logits, pos, 16, 0.0, 1.0, None, 0, None)[0]

    decode_s = _time(decode) / 16
    files = sum((bank.path / name).stat().st_size for name in bank._files())
    device = sum(int(np.prod(a.shape)) * a.dtype.itemsize
                 for a in jax.tree.leaves(device_bank.arrays))
    return {"tokens": bank.n_tokens, "documents": bank.n_docs, "chunks": bank.n_chunks,
            "exact_match": float(right.mean()), "answer_nll": float(forced_nll.sum()) / count,
            "answer_token_acc": hits / count,
            # The reading alone: the queries whose needle some routing layer brought into memory.
            "needle_in_memory": float(in_memory.mean()),
            "exact_match_in_memory": (float(right[in_memory].mean()) if in_memory.any()
                                      else None),
            "answer_token_acc_in_memory": (mem_hits / mem_count if mem_count else None),
            # The reading when the routing ranked right: the needle first in every routing layer.
            "needle_first_everywhere": float(ranked.mean()),
            "exact_match_first_everywhere": (float(right[ranked].mean()) if ranked.any()
                                             else None),
            # where the answers go wrong: each answer token's accuracy (teacher forced, EOS last)
            "token_acc_by_position": _accuracy_by_position(forced_hits),
            "token_acc_by_position_in_memory": _accuracy_by_position(in_mem_hits),
            "recall_topk": {str(k): v / len(needles) for k, v in sorted(found.items())},
            "recall_1": {str(k): v / len(needles) for k, v in sorted(first_choice.items())},
            "near_misses": (near_misses(choices, needles, doc_keys, bank.n_docs)
                            if doc_keys is not None else None),
            "prefill_s": prefill_s, "decode_s_per_token": decode_s,
            "bank_bytes_per_token": files / bank.n_tokens, "device_bank_bytes": device,
            "per_query": per_query}


def run_niah(checkpoint: str, sizes: list[int], out_dir: Path, *, queries: int, batch: int,
             max_new_tokens: int, overrides=(), seed: int = EVAL_SEED,
             kv_on_host: bool = False) -> dict[str, Any]:
    if not 0 <= seed < TRAIN_SEED_BASE:
        raise ValueError(f"niah: --seed {seed} is outside [0, 2**40); seeds from 2**40 up are "
                         "the training data's (data/synthetic_msa.py), so an evaluation drawn "
                         "with one could repeat training documents")
    loaded = load_model(checkpoint, overrides=list(overrides))
    model, tok = loaded.model, loaded.tokenizer
    col = niah_collection(loaded, sizes, queries, seed=seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bank"
    src = _msa_source(loaded)
    longest = max(d.size for d in col["docs"])
    limit = max(longest, src.max_doc_length if src is not None else 0)
    rows = []
    start = 0
    for size, stop in zip(sorted(sizes), col["prefix"]):
        part = col["docs"][start:stop]
        t0 = time.perf_counter()
        bank = mb.build_bank(model, part, path, append=start > 0, overwrite=start == 0,
                             max_doc_length=limit, row_len=max(256, limit), progress=True)
        enc_s = time.perf_counter() - t0
        row = evaluate_size(model, tok, bank, col["needles"], batch=batch,
                            max_new_tokens=max_new_tokens, mesh=loaded.mesh,
                            doc_keys=col["doc_keys"], kv_on_host=kv_on_host)
        row.update(size=format_length(size),
                   encode_tokens_per_s=sum(d.size for d in part) / enc_s)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "per_query"}), file=sys.stderr,
              flush=True)
        start = stop
    result = {"checkpoint": str(checkpoint), "step": loaded.step, "queries": queries,
              "seed": seed, "kv_on_host": kv_on_host,
              "top_k": model.cfg.msa.top_k, "chunk": model.cfg.msa.chunk,
              "kv_chunk": model.cfg.msa.resolved_kv_chunk,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    (out_dir / "memory_niah.json").write_text(json.dumps(result, indent=1))
    return result


def markdown(result: dict[str, Any]) -> str:
    layers = sorted({k for r in result["rows"] for k in r["recall_topk"]}, key=int)

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    head = ("| bank | docs | exact match | answer token acc | needle in memory | exact match / "
            "token acc with it | needle first everywhere / exact match then | " + " | ".join(
                f"needle first / in top-{result['top_k']}, layer {k}" for k in layers)
            + " | encode tok/s | prefill s | decode ms/token | bytes/token |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        routing = " | ".join(f"{100 * r['recall_1'][k]:.0f}% / {100 * r['recall_topk'][k]:.0f}%"
                             for k in layers)
        lines.append(f"| {r['size']} | {r['documents']} | {pct(r['exact_match'])} | "
                     f"{pct(r['answer_token_acc'])} | {pct(r['needle_in_memory'])} | "
                     f"{pct(r['exact_match_in_memory'])} / "
                     f"{pct(r['answer_token_acc_in_memory'])} | "
                     f"{pct(r['needle_first_everywhere'])} / "
                     f"{pct(r['exact_match_first_everywhere'])} | " + routing
                     + f" | {r['encode_tokens_per_s']:,.0f} | {r['prefill_s']:.3f} | "
                     f"{1000 * r['decode_s_per_token']:.2f} | {r['bank_bytes_per_token']:.0f} |")
    return "\n".join(lines)


# CLI ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aiinfra_jax.eval.memory",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="encode a document collection into a bank")
    b.add_argument("--checkpoint", required=True)
    b.add_argument("--docs", required=True, help=".jsonl, text file, or folder of .txt files")
    b.add_argument("--out", required=True)
    b.add_argument("--append", action="store_true", help="add to an existing bank")
    b.add_argument("--overwrite", action="store_true", help="replace an existing bank")
    b.add_argument("--field", default="text", help="the text field of .jsonl documents")
    b.add_argument("--max-doc-length", type=int, default=1024)
    b.add_argument("--no-bos", action="store_true", help="do not prepend BOS to documents")
    q = sub.add_parser("query", help="answer a prompt over a bank")
    q.add_argument("--checkpoint", required=True)
    q.add_argument("--bank", required=True)
    q.add_argument("--prompt", required=True)
    q.add_argument("--max-new-tokens", type=int, default=32)
    n = sub.add_parser("niah", help="needle in a haystack over banks of growing size")
    n.add_argument("--checkpoint", required=True)
    n.add_argument("--sizes", default="32k,128k,1m")
    n.add_argument("--queries", type=int, default=50)
    n.add_argument("--batch", type=int, default=25)
    n.add_argument("--max-new-tokens", type=int, default=12)
    n.add_argument("--out-dir", required=True)
    n.add_argument("--seed", type=int, default=EVAL_SEED,
                   help=f"draws the collection: documents, keys, values, needle places "
                        f"(default {EVAL_SEED}; any value in [0, 2**40))")
    for p in (q, n):
        p.add_argument("--kv-on-host", action="store_true",
                       help="leave the bank's keys and values in their files and read only the "
                            "chosen documents' (the device holds the routing keys alone)")
    for p in (b, q, n):
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="run-time overrides of the model (model.msa.implementation=xla, ...)")
    args = ap.parse_args(argv)
    try:
        if args.command == "build":
            loaded = load_model(args.checkpoint, overrides=args.set)
            docs, ids = mb.read_documents(args.docs, loaded.tokenizer, field=args.field,
                                          bos=not args.no_bos)
            bank = mb.build_bank(loaded.model, docs, args.out, ids=ids, append=args.append,
                                 overwrite=args.overwrite, max_doc_length=args.max_doc_length,
                                 progress=True)
            print(f"bank {args.out}: {bank.n_docs} documents, {bank.n_tokens} tokens, "
                  f"{bank.n_chunks} routing chunks and {bank.n_kv_chunks} key/value chunks per "
                  f"routing layer {list(bank.layers)}")
        elif args.command == "query":
            loaded = load_model(args.checkpoint, overrides=args.set)
            tok = loaded.tokenizer
            bank = mb.MemoryBank.open(args.bank, model=loaded.model)
            prompt = [tok.bos_id] + list(tok.encode(args.prompt))
            device_bank = bank.to_device(loaded.mesh, kv_on_host=args.kv_on_host)
            ans = mb.generate_from_bank(loaded.model, device_bank, [prompt],
                                        max_new_tokens=args.max_new_tokens, eos_id=tok.eos_id,
                                        mesh=loaded.mesh, vocab=tok.vocab_size)
            ids = bank.doc_ids()
            print(_answer_text(tok, np.asarray(ans.result.tokens)[0],
                               int(ans.result.lengths[0])))
            for layer, chosen in ans.documents.items():
                print(f"layer {layer} read documents: "
                      f"{[ids[d] for d in chosen[0].tolist() if d >= 0]}", file=sys.stderr)
        else:
            sizes = [parse_length(s) for s in args.sizes.split(",") if s.strip()]
            result = run_niah(args.checkpoint, sizes, Path(args.out_dir), queries=args.queries,
                              batch=args.batch, max_new_tokens=args.max_new_tokens,
                              overrides=args.set, seed=args.seed,
                              kv_on_host=args.kv_on_host)
            print(markdown(result))
    except (mb.BankError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
