"""`python -m memtrain prepare-data`: build a recipe's token store (text, or chat and instruction rows) ahead of a job
(for example once on a login node, on shared storage) and print one line: documents, tokens, bytes, seconds, where."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from memtrain.errors import ArgumentParser, UserError, cli_entry


def summary(store, built_here: bool, seconds: float, rows: dict[str, int], seq_len: int, label: str = "") -> str:
    m = store.manifest
    how = f"built in {m['seconds']:.1f} s with {m['workers']} worker(s)" if built_here else \
        f"already built (opened in {seconds:.2f} s)"
    split = ", ".join(f"{name} {n}" for name, n in rows.items())
    return (f"memtrain prepare-data: {label}{m['documents']} documents, {m['tokens']} tokens, {m['chars'] / 1e6:.1f} "
            f"MB of text, {how}; rows of seq_len {seq_len}: {split}; store {store.path}")


def prepare_corpus(cfg, tokenizer, label: str = "") -> str:
    """Build (or find) one corpus's store; its summary line."""
    from memtrain.model.corpus_reader import resolve_files  # noqa: PLC0415 pulls pydantic: heavy, kept off --help
    from memtrain.model.sample_view import split_view  # noqa: PLC0415 pulls numpy, pydantic: heavy, kept off --help
    from memtrain.model.token_store import open_store, store_key  # noqa: PLC0415 pulls numpy, pydantic: heavy, kept off --help

    files = resolve_files(cfg)
    existed = (Path(cfg.cache_dir) / f"store-{store_key(files, cfg, tokenizer)}").exists()
    start = time.perf_counter()
    store = open_store(files, cfg, tokenizer)
    seconds = time.perf_counter() - start
    splits = ("train", "eval") if cfg.eval_fraction else ("train",)
    rows = {name: len(split_view(store, cfg, name, len(files))) for name in splits}
    return summary(store, not existed, seconds, rows, cfg.seq_len, label)


def prepare_chat(cfg, tokenizer, seed: int) -> str:
    """Build (or find) the chat store of data.format chat / instruction; its summary line with the run's packing."""
    from memtrain.model.chat_data import PackedChat, check_template, report_line  # noqa: PLC0415 pulls torch: heavy, kept off --help
    from memtrain.model.chat_store import chat_store_path, open_chat_samples  # noqa: PLC0415 pulls numpy, pydantic: heavy, kept off --help
    from memtrain.model.corpus_reader import resolve_files  # noqa: PLC0415 pulls pydantic: heavy, kept off --help

    files = resolve_files(cfg)
    check_template(tokenizer, cfg)
    path = chat_store_path(files, cfg, tokenizer)
    existed = path.exists()
    start = time.perf_counter()
    samples = open_chat_samples(files, cfg, tokenizer)
    seconds = time.perf_counter() - start
    m = json.loads((path / "manifest.json").read_text())
    how = f"built in {m['seconds']:.1f} s with {m['workers']} worker(s)" if not existed else \
        f"already built (opened in {seconds:.2f} s)"
    packed = PackedChat(samples, cfg, tokenizer.vocab_size, seed)
    return (f"memtrain prepare-data: {m['documents']} {cfg.format} samples, {m['tokens']} tokens, {how}; "
            f"{report_line(packed.report, cfg)}; store {path}")


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m memtrain prepare-data",
                       description="Tokenize a recipe's corpus (or each source of a data.sources blend, or its chat "
                                   "or instruction rows) into its token store (data.cache_dir) before a job; a run "
                                   "finds it there, and a new data.seq_len re-tokenizes nothing.")
    p.add_argument("--recipe", metavar="YAML", help="recipe file (default: the embedded tiny recipe)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a recipe key (data.paths, data.workers, data.cache_dir, ...)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="N",
                   help="data-parallel ranks of the run, for a blend's epochs per source (default 1)")
    return p


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    from memtrain.config.recipe import load_recipe  # noqa: PLC0415 pulls pydantic: heavy, kept off --help
    from memtrain.model.corpus_reader import source_sections  # noqa: PLC0415 pulls pydantic: heavy, kept off --help
    from memtrain.model.tokenizer import build_tokenizer  # noqa: PLC0415 pulls numpy: heavy, kept off --help

    args = parser().parse_args(argv)
    if args.data_parallel < 1:
        raise UserError(f"--data-parallel: must be positive (got {args.data_parallel})")
    recipe = load_recipe(args.recipe, args.overrides)
    cfg = recipe.data
    if cfg.random_tokens:
        raise UserError("data.random_tokens: true reads no file, so there is no store to prepare")
    tokenizer = build_tokenizer(cfg.tokenizer)
    if cfg.format != "text":
        print(prepare_chat(cfg, tokenizer, recipe.train.seed))
        return
    if not cfg.sources:
        print(prepare_corpus(cfg, tokenizer))
        return
    for i, source in enumerate(source_sections(cfg)):
        print(prepare_corpus(source, tokenizer, f"source {i}: "))
    from memtrain.model.data import blend_plan_line, prepare_data  # noqa: PLC0415 pulls numpy, pydantic, torch: heavy, kept off --help

    t = recipe.train
    run_rows = t.max_steps * t.micro_batch_size * t.grad_accum_steps * args.data_parallel
    print(blend_plan_line(prepare_data(cfg, t.seed), run_rows))


if __name__ == "__main__":
    main()
